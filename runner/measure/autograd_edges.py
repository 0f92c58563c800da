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
    itself (its gradient accumulator): what hands the weight this call's gradient, apart from any
    other use of a weight tied to it."""
    if start is None or output.grad_fn is None:
        return []
    with _disable_current_modes(), torch.enable_grad():
        accumulator = weight.view_as(weight).grad_fn.next_functions[0][0]
    return [
        (node, index)
        for node in made_since([output.grad_fn], start)
        for index, (following, _) in enumerate(node.next_functions)
        if following is accumulator
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
