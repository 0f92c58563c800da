"""The matmul-error probe's arithmetic (runner/measure/matmul_error.py), in bounded memory and
outside the step's accounting: a product's fp32 reference is computed and compared a block of
the output's rows at a time (`row_blocks`), so that no temporary it makes holds more than a block,
and none of it runs under the audit's dispatch modes, autograd or autocast (`aside`): the step's
peak memory, FLOPs, precision manifest and projection are its own."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

# A block: at most this many elements (16 KiB in fp32), or 1/PARTS of the tensor where that is
# more (a large GEMM in PARTS blocks, not thousands); in multiples of ROWS rows (a GEMM's kernel
# blocking: the rows then round as the whole product's do).
BLOCK = 2**12
PARTS = 16
ROWS = 16


@contextlib.contextmanager
def aside(device: torch.device):
    """Outside the step's own accounting: no dispatch mode (the audit's, the FLOP counters), no
    autograd, no autocast."""
    with _disable_current_modes(), torch.no_grad(), torch.autocast(device.type, enabled=False):
        yield


def row_blocks(rows: int, cols: int, multiple: int = ROWS) -> list[slice]:
    """Slices of `rows` rows `cols` wide, each at most max(BLOCK, rows·cols / PARTS) elements,
    a multiple of `multiple` rows (a quantization tile's) but the last."""
    size = max(BLOCK, rows * cols // PARTS)
    step = max(multiple, size // max(cols, 1) // multiple * multiple)
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def _fp32(b: Tensor, cols: int) -> list[tuple[slice, Tensor]]:
    """`b` in fp32 as blocks of its rows: itself whole where it is fp32 (no copy), else each
    block cast when used."""
    if b.dtype == torch.float32:
        return [(slice(None), b)]
    return [(s, b[s]) for s in row_blocks(b.shape[0], max(b.shape[1], cols))]


def product_sums(run: Tensor, a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """[Σ ref², Σ (run − ref)²] in float64 of ref = a·bᵀ in fp32 (a: m × k, b: n × k, run: m × n,
    what the run computed), a block of rows at a time. With `bias` (n), ref = a·bᵀ + bias, the
    whole output the run rounded: the output's rounding is at the bias's magnitude, which a
    product taken out of it (run − bias) would be charged with, far above a small product's own.
    Where a is fp32 and b is not, the transposed product (b·aᵀ against runᵀ), so that the whole
    operand needs no copy."""
    if bias is None and a.dtype == torch.float32 and b.dtype != torch.float32:
        run, a, b = run.t(), b, a
    bias = None if bias is None else bias.float()
    sums = torch.zeros(2, dtype=torch.float64, device=run.device)
    for rows in row_blocks(a.shape[0], max(a.shape[1], run.shape[1])):
        a32 = a[rows].float()
        for cols, b32 in _fp32(b, a32.shape[0]):
            got = run[rows, cols].float()
            if bias is None:
                ref = a32 @ b32.float().t()
            else:
                ref = torch.addmm(bias[cols], a32, b32.float().t())
            sums += torch.stack([ref.double().square().sum(), (got - ref).double().square().sum()])
    return sums
