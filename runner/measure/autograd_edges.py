"""The autograd graph as the matmul-error probe (runner/measure/matmul_error.py) reads it: the
nodes one module call made, and those of them that hand a weight its gradient."""

from __future__ import annotations

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
    edges, todo, seen = [], [output.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(node)
        if node._sequence_nr() < start:
            continue  # made before this call began: an input's
        for index, (following, _) in enumerate(node.next_functions):
            if following is accumulator:
                edges.append((node, index))
            else:
                todo.append(following)
    return edges
