"""The GEMM the dispatcher sees: `amp_runner::fp4_mm`, one op per FP4 GEMM of
runner/precision/fp4.py's Linears, whose operands are the packed FP4 data
(torch.float4_e2m1fn_x2, two values a byte) and the scales: the precision manifest reads the
format off them (runner/measure/manifest.py), and the FLOP counter has its formula."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from runner.precision.fp4_quant import Quantized, dequantize


@torch.library.custom_op("amp_runner::fp4_mm", mutates_args=())
def fp4_mm(
    a: Tensor,
    a_scales: Tensor,
    a_tensor_scale: Tensor,
    b: Tensor,
    b_scales: Tensor,
    b_tensor_scale: Tensor,
    roles: str,
) -> Tensor:
    """a @ bᵀ of two FP4 tensors (packed E2M1 data, block scales, per-tensor scale), both
    quantized along their last dimension (the inner one), dequantized and multiplied in fp32.
    `roles`: the operands' roles, "x,w" (forward), "dy,w" (input's gradient), "dy,x" (weight's)."""
    device = a.device.type
    with torch.autocast(device, enabled=False):  # autocast falls through a custom op's kernel
        return dequantize(a, a_scales, a_tensor_scale) @ dequantize(b, b_scales, b_tensor_scale).t()


@fp4_mm.register_fake
def _fp4_mm_fake(a, a_scales, a_tensor_scale, b, b_scales, b_tensor_scale, roles):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.float32)


def fp4_mkn(a_shape, b_shape) -> tuple[int, int, int]:
    """M, K, N of `fp4_mm(a, b)` = a @ bᵀ from its packed operands' shapes (M × K/2 and N × K/2
    bytes): K counts values, two E2M1 values a byte. The one place the packing is unpacked for
    the FLOP formula and the precision manifest's GEMM records (runner/measure/matmuls.py)."""
    return int(a_shape[0]), 2 * int(a_shape[1]), int(b_shape[0])


@register_flop_formula(torch.ops.amp_runner.fp4_mm)
def _fp4_mm_flops(a_shape, _as, _at, b_shape, *_args, out_shape=None, **_kwargs) -> int:
    m, k, n = fp4_mkn(a_shape, b_shape)
    return 2 * m * k * n


FP4_MM = torch.ops.amp_runner.fp4_mm


def _mm(a: Quantized, b: Quantized, roles: str) -> Tensor:
    return FP4_MM(a.packed(), a.scales, a.tensor_scale, b.packed(), b.scales, b.tensor_scale, roles)


__all__ = [
    "fp4_mkn",
    "fp4_mm",
]
