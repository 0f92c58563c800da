"""The autograd graph as the audit reads it: the nodes one module call made (ModuleStack's
owners, runner/measure/module_stack.py), and those of them that hand a weight its gradient (the
matmul-error probe's, runner/measure/matmul_error.py)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes


def next_node() -> int:
    """The sequence number the next autograd node made on this thread gets."""
    with _disable_current_modes(), torch.enable_grad():
        return (torch.zeros((), requires_grad=True) * 1).grad_fn._sequence_nr() + 1


def weight_edges(output: Tensor, weight: Tensor, start: int | None) -> list[tuple]:
    """(node, input index) of each autograd node made since `start` whose input is the weight
    itself (its gradient accumulator) or autocast's cast of it: what hands the weight this call's
    gradient, apart from any other use of a weight tied to it. Autocast casts a weight once per
    forward and caches the cast, so a module called twice shares the first call's cast node,
    which receives both calls' gradients: each call's own are those on the edges into it."""
    if start is None or output.grad_fn is None:
        return []
    with _disable_current_modes(), torch.enable_grad():
        accumulator = weight.view_as(weight).grad_fn.next_functions[0][0]

    def into_weight(node) -> bool:
        return node is accumulator or (
            type(node).__name__ == "ToCopyBackward0"
            and tuple(f for f, _ in node.next_functions) == (accumulator,)
        )

    return [
        (node, index)
        for node in made_since([output.grad_fn], start)
        if not into_weight(node)
        for index, (following, _) in enumerate(node.next_functions)
        if into_weight(following)
    ]


def made_since(roots: list, start: int) -> Iterator:
    """The autograd nodes reachable from `roots` that were made since sequence number `start`
    (a module call's own: the walk stops at nodes made before it, an input's), each once;
    gradient accumulators left out."""
    todo, seen = list(roots), set()
    while todo:
        node = todo.pop()
        if node is None or node in seen or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(node)
        if node._sequence_nr() < start:
            continue  # made before this call began: an input's
        yield node
        todo.extend(following for following, _ in node.next_functions)


def consumer_edges(roots: list, start: int, targets: dict) -> Iterator[tuple]:
    """(node, input index, target's value) of each edge, from a node reachable from `roots` and
    made since `start`, into a tensor of `targets` ((its grad_fn, its output_nr) → value): where
    the tensor's gradient comes from, and so where a cast into its dtype happens."""
    for node in made_since(roots, start):
        for index, edge in enumerate(node.next_functions):
            if edge in targets:
                yield node, index, targets[edge]
