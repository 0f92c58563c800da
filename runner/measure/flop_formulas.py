"""The FLOP formula of each matmul-like aten op the precision audit (runner/measure/flops.py)
counts: torch's own (torch.utils.flop_counter's registry: mm, addmm, bmm, baddbmm, the
convolutions, the attention kernels), the CPU flash-attention kernels, dot/vdot/mv/addmv
(matmul's 1-D cases), and the composite ops that reach the dispatcher whole under
`torch.inference_mode()` (evaluation: runner/train/evaluation.py). There autograd's keys are off,
so linear, matmul, einsum, scaled-dot-product attention and the conv1d/2d/3d and conv_transpose
functions are not decomposed into mm, bmm, convolution or a flash kernel before a dispatch mode
sees them; without a formula of their own they would pass as no matmul at all. Each counts two
FLOPs per multiply-add, as torch's do, so an op counts the same whether it arrives whole or
decomposed. A formula returns None where the op does no matmul (an einsum that only multiplies
elementwise or sums)."""

from __future__ import annotations

from math import prod

import torch
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten


def _linear(x: torch.Tensor, weight: torch.Tensor, *args, out_val=None, **kwargs) -> int:
    """x @ weight.T."""
    return 2 * (x.numel() // x.shape[-1]) * weight.shape[0] * weight.shape[1]


def _matmul(a: torch.Tensor, b, *args, out_val: torch.Tensor, **kwargs) -> int:
    """torch.matmul of any ranks (dot, mv, mm, a broadcast bmm): each element of the output is a
    dot product over a's last dimension."""
    return 2 * out_val.numel() * a.shape[-1]


def _addmv(bias, mat: torch.Tensor, vec, *args, out_val: torch.Tensor, **kwargs) -> int:
    return _matmul(mat, vec, out_val=out_val)


def _attention(query, key, value, *args, out_val=None, **kwargs) -> int:
    """query·keyᵀ, then the scores·value, for every query row of every head (a grouped-query
    key/value is shared by several heads, as the kernels broadcast it); a causal mask's skipped
    half is counted, as torch's attention formulas do."""
    rows = query.numel() // query.shape[-1]  # batch × heads × query length
    return 2 * rows * key.shape[-2] * (query.shape[-1] + value.shape[-1])


def _conv(x, weight, *args, out_val: torch.Tensor, **kwargs) -> int:
    """Each output element a dot product over its window: in_channels/groups × the kernel."""
    return 2 * out_val.numel() * prod(weight.shape[1:])


def _conv_transpose(x, weight, *args, out_val=None, **kwargs) -> int:
    """Each input element spread through out_channels/groups × the kernel."""
    return 2 * x.numel() * prod(weight.shape[1:])


def _labels(term: str, ndim: int, dots: int | None = None) -> list:
    """The labels of one operand's subscripts, "..." expanded to its dimensions, right-aligned
    (broadcast) across operands; `dots`: how many "..." stands for in the output."""
    head, ellipsis, tail = term.partition("...")
    if not ellipsis:
        return list(term)
    n = ndim - len(head) - len(tail) if dots is None else dots
    return [*head, *(("...", n - 1 - i) for i in range(n)), *tail]


def _einsum(equation: str, operands, path=None, *, out_val=None) -> int | None:
    """The pairwise contractions torch runs: in `path`'s order where opt_einsum gave one, else
    left to right. A label that no other operand and not the output needs is summed out before
    its operand is multiplied; a pair that shares no summed label is an elementwise product (no
    matmul); a pair that does is a bmm over every label either holds."""
    if len(operands) < 2:
        return None
    inputs, arrow, output = equation.replace(" ", "").partition("->")
    terms = [_labels(t, o.ndim) for t, o in zip(inputs.split(","), operands, strict=True)]
    sizes: dict = {}
    for labels, operand in zip(terms, operands, strict=True):
        for label, size in zip(labels, operand.shape, strict=True):
            sizes[label] = max(sizes.get(label, 1), size)
    dots = max((label[1] + 1 for label in sizes if isinstance(label, tuple)), default=0)
    if arrow:
        kept = set(_labels(output, 0, dots))
    else:  # numpy's implicit output: each label seen once, and the broadcast dimensions
        counts = [label for labels in terms for label in labels]
        kept = {label for label in counts if isinstance(label, tuple) or counts.count(label) == 1}
    held = [set(t) for t in terms]
    pairs = list(zip(path[::2], path[1::2], strict=True)) if path else []
    pairs += [(0, 1)] * (len(held) - 1 - len(pairs))
    flops = 0
    for i, j in pairs:
        left, right = held[i], held[j]
        others = kept.union(*(h for k, h in enumerate(held) if k not in (i, j)))
        left, right = left & (others | right), right & (others | left)
        if (left & right) - others:
            flops += 2 * prod(sizes[label] for label in left | right)
        held = [h for k, h in enumerate(held) if k not in (i, j)] + [(left | right) & others]
    return flops or None


def flop_formulas() -> dict:
    """{op packet: formula(*args, **kwargs, out_val=output) → FLOPs or None}."""
    formulas = dict(flop_registry)
    # The CPU flash-attention kernels take the same leading arguments as the CUDA ones.
    for cpu, cuda in (
        ("_scaled_dot_product_flash_attention_for_cpu", aten._scaled_dot_product_flash_attention),
        (
            "_scaled_dot_product_flash_attention_for_cpu_backward",
            aten._scaled_dot_product_flash_attention_backward,
        ),
    ):
        if hasattr(aten, cpu) and cuda in formulas:
            formulas[getattr(aten, cpu)] = formulas[cuda]
    # Whole under inference_mode (the formulas above see their decomposition elsewhere).
    formulas[aten.linear] = _linear
    formulas[aten.matmul] = _matmul
    # matmul's 1-D cases (torch's registry has no formula for them, in either path)
    formulas |= {aten.dot: _matmul, aten.vdot: _matmul, aten.mv: _matmul, aten.addmv: _addmv}
    formulas[aten.einsum] = _einsum
    formulas[aten.scaled_dot_product_attention] = _attention
    for name in ("conv1d", "conv2d", "conv3d"):
        formulas[getattr(aten, name)] = _conv
    for name in ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"):
        formulas[getattr(aten, name)] = _conv_transpose
    return formulas
