"""What a matmul's operands lose when quantized to its format, for each matmul's measured error
(runner/measure/matmul_error.py): each operand's format per direction, read off the module as the
run converted it (`operand_formats`), and one place per format that quantizes an operand as the
run does (`counts`): of its nonzero elements, how many flush to zero and how many are clamped (they
round, to nearest after scaling, past the format's largest finite value: one that rounds to the
largest anyway is not), and its amax.

Every operand comes as a 2-D matrix whose last dimension is the GEMM's inner one (the dimension a
row scale or a block runs along): forward x (tokens × in) and W (out × in); the input's gradient
dy (tokens × out) and Wᵀ (in × out); the weight's gradient dyᵀ (out × tokens) and xᵀ (in × tokens).

- bf16, fp16: the cast (fp16's values from 65520 count as clamped: they overflow);
- fp8 e4m3/e5m2, tensorwise or rowwise: torchao's dynamic scaling as torchao computes it, largest
  / amax over the tensor or over each row in float64, then float32, rounded down to a power of two
  where the layer's config says so (the rowwise recipes), then the cast saturated at the format's
  largest; Float8Linear's input cast to CUDA autocast's dtype first where that is on;
- mxfp8: e4m3 in blocks of 32 with a power-of-two scale, 2^ceil(log2(amax / 448)) (torchao's RCEIL);
- nvfp4, mxfp4: the project's own quantizer (runner/precision/fp4_quant.py), with the run's tiles
  and its own random Hadamard transform of the weight gradient's operands; round to nearest (a
  stochastically rounded gradient's shares are round to nearest's)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runner.measure.error_sums import row_blocks
from runner.measure.matmuls import FORWARD, INPUT_GRAD, WEIGHT_GRAD
from runner.measure.truth import short
from runner.precision.fp4 import Fp4Linear
from runner.precision.fp4_quant import E2M1_MAX, HADAMARD_SIZE, Fp4Format, quantize
from runner.precision.fp32_islands import is_island
from runner.precision.recipe import HIGH

ROLES = {FORWARD: ("x", "w"), INPUT_GRAD: ("dy", "w"), WEIGHT_GRAD: ("dy", "x")}
_FP8 = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
MX_BLOCK = 32
E2M1_EPS = 0.5  # E2M1's spacing at 1 (one significand bit)


@dataclass(frozen=True)
class OperandFormat:
    """An operand's format: `name` as the table shows it; `dtype` its elements' (None: fp32,
    nothing rounds, or FP4); `scaling` (tensorwise, rowwise, block) where scaled, `pow2` where
    torchao rounds the scale down to a power of two (round_scales_to_power_of_2), `through`
    the dtype the run casts the operand to before scaling it (Float8Linear under CUDA
    autocast); `fp4`, `tile` and `rotate` (the run's random Hadamard transform along the
    tokens) for FP4."""

    name: str
    dtype: torch.dtype | None = None
    scaling: str = ""
    pow2: bool = False
    through: torch.dtype | None = None
    fp4: Fp4Format | None = None
    tile: tuple[int, int] = (1, 1)
    rotate: Callable[[Tensor], Tensor] | None = None


FP32 = OperandFormat("fp32")


def is_cast(f: OperandFormat) -> bool:
    """Whether `f` is a plain cast into a narrower float (bf16, fp16): no scale, no blocks."""
    return f.dtype is not None and not f.scaling


def cast(dtype: torch.dtype | None) -> OperandFormat:
    if dtype is None or dtype == torch.float32:
        return FP32
    return OperandFormat(short(dtype), dtype)


def fp8(dtype: torch.dtype, rowwise: bool, pow2: bool = False, through=None) -> OperandFormat:
    scaling = "rowwise" if rowwise else "tensorwise"
    return OperandFormat(f"fp8 {_FP8[dtype]} {scaling}", dtype, scaling, pow2, through)


MXFP8 = OperandFormat(f"mxfp8 e4m3 block {MX_BLOCK}", torch.float8_e4m3fn, "block")


def fp4(fmt: Fp4Format, tile: tuple[int, int], rotate=None) -> OperandFormat:
    shape = f"block {tile[1]}" if tile[0] == 1 else f"tile {tile[0]}×{tile[1]}"
    rht = ", rotated" if rotate else ""
    return OperandFormat(
        f"{fmt.name} e2m1 {shape}{rht}", scaling="block", fp4=fmt, tile=tile, rotate=rotate
    )


def _float8(config, high: OperandFormat, computed: str) -> dict[str, tuple[str, tuple]]:
    """torchao float8's cast configs, per direction (DISABLED: the high-precision operand, a GEMM
    of two such computed in `computed`). Its scales rounded down to a power of two where the
    config says so (the rowwise recipes), its input first cast to CUDA autocast's dtype where
    that is on, as Float8Linear.forward does."""
    pow2 = config.round_scales_to_power_of_2
    through = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None

    def one(cast_config, role: str) -> OperandFormat:
        if cast_config.scaling_type.name == "DISABLED":
            return high
        rowwise = cast_config.scaling_granularity.name == "AXISWISE"
        return fp8(cast_config.target_dtype, rowwise, pow2, through if role == "x" else None)

    pairs = {
        FORWARD: (config.cast_config_input, config.cast_config_weight),
        INPUT_GRAD: (config.cast_config_grad_output, config.cast_config_weight_for_grad_input),
        WEIGHT_GRAD: (
            config.cast_config_grad_output_for_grad_weight,
            config.cast_config_input_for_grad_weight,
        ),
    }
    out = {}
    for direction, casts in pairs.items():
        formats = tuple(map(one, casts, ROLES[direction]))
        out[direction] = ("fp8" if any(f.dtype in _FP8 for f in formats) else computed, formats)
    return out


def operand_formats(
    module: nn.Module, autocast: torch.dtype | None, converted: bool, fast: frozenset = frozenset()
) -> dict[str, tuple[str, tuple[OperandFormat, OperandFormat]]]:
    """direction → (the format it computes in, its two operands' formats), for `module` called
    under `autocast` (its dtype, None where off); `converted`: whether converted Linears run in
    their format now (a staged run's other stages run them plain); `fast`: the dtypes the CPU's
    fast kernels compute in fp32 from their rounded operands (the manifest's fp32 from bf16)."""
    weight = module.weight
    if is_island(module) or (autocast is None and weight.dtype == torch.float32):
        high = FP32
    else:  # autocast's dtype, or the weights' own (bf16_true, fp16_master)
        high = cast(autocast or weight.dtype)

    def computed(fmt: OperandFormat) -> str:  # a high-precision GEMM's format, as the manifest's
        return FP32.name if fmt.dtype in fast else fmt.name

    config = getattr(module, "config", None)
    if converted and hasattr(config, "cast_config_input"):  # torchao's Float8Linear
        return _float8(config, high, computed(high))
    if converted and type(module).__name__ == "MXFP8Linear":
        low = ("mxfp8", (MXFP8, MXFP8))
        weight_grad = ("fp32", (FP32, FP32)) if getattr(module, "wgrad_with_hp", False) else low
        return {FORWARD: low, INPUT_GRAD: low, WEIGHT_GRAD: weight_grad}
    if converted and isinstance(module, Fp4Linear):
        r = module.recipe
        block = r.fmt.block
        w = fp4(r.fmt, (block, block) if r.weight_2d else (1, block))
        row = fp4(r.fmt, (1, block))
        rotated = fp4(r.fmt, (1, block), r.rotate if r.rht else None)
        low = {FORWARD: (row, w), INPUT_GRAD: (row, w), WEIGHT_GRAD: (rotated, rotated)}
        out = {}
        for direction, kept in zip(ROLES, module.formats, strict=True):  # a recipe's, per GEMM
            fmt = FP32 if kept == "fp32" else cast(torch.bfloat16)
            out[direction] = (
                (computed(fmt), (fmt, fmt)) if kept in HIGH else (r.fmt.name, low[direction])
            )
        return out
    return dict.fromkeys(ROLES, (computed(high), (high, high)))


def _padded(t: Tensor, rows: int, cols: int) -> Tensor:
    return F.pad(t, (0, -t.shape[1] % cols, 0, -t.shape[0] % rows))


def _rotated(t: Tensor, rotate) -> Tensor:
    """`t` (its inner dimension the tokens) after the run's own random Hadamard transform, which
    Fp4Linear applies along the tokens, zero tokens padding them to its 16 as the layer's do."""
    return rotate(_padded(t, 1, HADAMARD_SIZE).t()).t()


def counts(t: Tensor, f: OperandFormat) -> Tensor:
    """[nonzero, flushed to zero, clamped, amax] of `t` (2-D, the inner dimension last) quantized
    to `f`, as float64 on its device; a block of rows at a time (runner/measure/error_sums.py),
    the tensor's amax first (a tensorwise scale's, nvfp4's tensor scale)."""
    blocks = row_blocks(t.shape[0], t.shape[1], f.tile[0])
    amax = torch.zeros((), device=t.device)
    for rows in blocks:
        amax = torch.maximum(amax, _block(t, rows, f).abs().amax())
    found = torch.zeros(3, dtype=torch.float64, device=t.device)
    for rows in blocks:
        found += _counts(_block(t, rows, f), f, amax)
    return torch.cat([found, amax.double().reshape(1)])


def _block(t: Tensor, rows: slice, f: OperandFormat) -> Tensor:
    """Rows of `t` in fp32, as the run scales them: through its cast where it has one, after its
    rotation where it has one."""
    part = t[rows].detach()
    part = (part if f.through is None else part.to(f.through)).float()
    return part if f.rotate is None else _rotated(part, f.rotate)


def _rounds_past(magnitude: Tensor, largest: float, eps: float) -> Tensor:
    """Whether each magnitude, already scaled, rounds to nearest (ties to even) past `largest`,
    the largest finite value of a format with `eps` (its spacing at 1): what saturates, or
    overflows, beyond what rounds to the largest anyway. The point halfway to the next binade
    value up is a tie, which goes to whichever of the two has an even significand."""
    ulp = 2.0 ** math.floor(math.log2(largest)) * eps
    halfway = largest + ulp / 2
    odd = round(largest / ulp) % 2 == 1  # then the tie goes up: past it
    return magnitude >= halfway if odd else magnitude > halfway


def _counts(t: Tensor, f: OperandFormat, whole: Tensor) -> Tensor:
    """[nonzero, flushed to zero, clamped] of a block `t` of the tensor whose amax is `whole`;
    clamped: what rounds past the format's largest finite value after scaling."""
    nonzero = t != 0
    if f.fp4 is not None:
        rows, cols = f.tile
        q = quantize(_padded(t, rows, cols), f.fp4, f.tile, whole=whole)
        reciprocal = ((1.0 / q.tensor_scale) / q.scales.float()).repeat_interleave(rows, 0)
        reciprocal = reciprocal.repeat_interleave(cols, 1)[: t.shape[0], : t.shape[1]]
        flushed = nonzero & ((q.codes[: t.shape[0], : t.shape[1]] & 7) == 0)
        clamped = _rounds_past(t.abs() * reciprocal, E2M1_MAX, E2M1_EPS)  # as the quantizer scales
    elif f.dtype is None:
        flushed = clamped = torch.zeros_like(nonzero)
    else:
        info = torch.finfo(f.dtype)
        scaled = t * _scale(t, f, info.max, whole)
        clamped = _rounds_past(scaled.abs(), info.max, info.eps)
        flushed = nonzero & (scaled.clamp(-info.max, info.max).to(f.dtype) == 0)
    return torch.stack([nonzero.sum(), flushed.sum(), clamped.sum()]).double()


def _scale(t: Tensor, f: OperandFormat, largest: float, whole: Tensor) -> Tensor | float:
    """The factor the run multiplies the operand by before the cast (`whole`: its amax): 1 for a
    plain cast. fp8's as torchao's amax_to_scale: largest / amax in float64, then float32, then
    rounded down to a power of two where the recipe says so."""
    if f.scaling in ("tensorwise", "rowwise"):
        amax = whole if f.scaling == "tensorwise" else t.abs().amax(dim=-1, keepdim=True)
        scale = (largest / amax.double().clamp(min=1e-12)).float()
        return torch.exp2(torch.floor(torch.log2(scale))) if f.pow2 else scale
    if f.scaling == "block":
        blocks = _padded(t, 1, MX_BLOCK).reshape(t.shape[0], -1, MX_BLOCK)
        amax = blocks.abs().amax(dim=-1, keepdim=True)
        exponent = torch.ceil(torch.log2(amax / largest)).clamp(-127, 127)
        # torchao's RCEIL: E8M0's smallest exponent (an amax of 0 included) scales by 1
        scale = torch.where(exponent > -127, torch.exp2(-exponent), torch.ones_like(amax))
        return scale.expand_as(blocks).reshape(t.shape[0], -1)[:, : t.shape[1]]
    return 1.0
