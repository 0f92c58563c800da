"""The FP4 formats and their quantizers (runner/precision/fp4.py's Linears use them): E2M1 values
in blocks, NVFP4's E4M3 block scales under an FP32 tensor scale, MXFP4's E8M0 (power-of-two) block
scales; round to nearest (ties to even) or stochastically; the random Hadamard transform's
matrix."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of codes 0..7 (sign: bit 3)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_TINY = 2.0**-6  # E4M3's smallest normal: torchao's floor for a block scale
CLIP_TOLERANCE = 1 + 2.0**-4  # E4M3's rounding of a scale down clips a block's largest this much
E8M0_EXPONENTS = (-127, 127)
E2M1_EMAX = 2  # floor(log2(6)): MX's shared exponent is the block's amax's minus this
HADAMARD_SIZE = 16
# Ties go to the even code (0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4):
# a magnitude counts past a tie point that rounds down only when above it.
_TIES = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


@dataclass(frozen=True)
class Fp4Format:
    name: str  # nvfp4 | mxfp4
    block: int  # values per scale along a GEMM's inner dimension
    scale_dtype: torch.dtype


NVFP4 = Fp4Format("nvfp4", 16, torch.float8_e4m3fn)
MXFP4 = Fp4Format("mxfp4", 32, torch.float8_e8m0fnu)
FORMATS = {f.name: f for f in (NVFP4, MXFP4)}
_BY_SCALE = {f.scale_dtype: f for f in (NVFP4, MXFP4)}


def format_of_scale(scale: Tensor) -> Fp4Format | None:
    """The FP4 format whose block scales `scale` holds (E4M3: NVFP4, E8M0: MXFP4)."""
    return _BY_SCALE.get(scale.dtype)


# --- the quantizers ------------------------------------------------------------------------


def e2m1_round(magnitude: Tensor) -> Tensor:
    """Codes 0..7 of E2M1 for magnitudes already scaled, rounded to nearest (ties to even),
    saturating at 6 (the hardware's satfinite conversion). NaN gives code 0: the scale carries it."""
    code = torch.zeros(magnitude.shape, dtype=torch.uint8, device=magnitude.device)
    for point, up in _TIES:
        code += (magnitude >= point if up else magnitude > point).to(torch.uint8)
    return code


def e2m1_stochastic(magnitude: Tensor, generator: torch.Generator | None) -> Tensor:
    """Codes 0..7 of E2M1, rounded up with the probability of the distance from the grid point
    below (unbiased between 0 and 6); saturating at 6."""
    grid = torch.tensor(E2M1_GRID, device=magnitude.device)
    m = magnitude.clamp(0, E2M1_MAX).nan_to_num(0.0).contiguous()
    below = (torch.bucketize(m, grid, right=True) - 1).clamp(0, 7)
    above = (below + 1).clamp(max=7)
    low, high = grid[below], grid[above]
    gap = torch.where(high > low, high - low, torch.ones_like(high))
    draw = torch.rand(m.shape, generator=generator, device=m.device)
    return (below + (draw < (m - low) / gap).long()).clamp(max=7).to(torch.uint8)


@dataclass
class Quantized:
    """A quantized 2-D tensor: `codes` (rows × cols, one E2M1 code a byte: sign in bit 3),
    `scales` (one per tile of `tile` = (rows, cols) values, in the format's scale dtype) and the
    per-tensor scale (fp32; 1 for MXFP4). `saturated` and `underflow`: per tile, whether its
    scale saturated (clamped at its format's largest, non-finite, or too small for the tile's
    largest value, which clipped at ±6 beyond the scale's rounding), and whether a tile not all
    zero quantized to all zeros."""

    codes: Tensor
    scales: Tensor
    tensor_scale: Tensor
    tile: tuple[int, int]
    saturated: Tensor | None = None
    underflow: Tensor | None = None

    def t(self) -> Quantized:
        """The transposed tensor, the same values (a 2-D tile's scales transposed with it)."""
        return Quantized(
            self.codes.t().contiguous(),
            self.scales.t().contiguous(),
            self.tensor_scale,
            self.tile[::-1],
        )

    def packed(self) -> Tensor:
        """Two codes a byte (even column in the low nibble), as torch.float4_e2m1fn_x2."""
        c = self.codes
        return (c[:, 0::2] | (c[:, 1::2] << 4)).view(torch.float4_e2m1fn_x2)

    def dequantize(self) -> Tensor:
        return dequantize(self.packed(), self.scales, self.tensor_scale)


def _tiles(x: Tensor, tile: tuple[int, int]) -> Tensor:
    rows, cols = x.shape
    br, bc = tile
    if rows % br or cols % bc:
        raise ValueError(f"a {rows}×{cols} tensor does not split into {br}×{bc} tiles")
    return x.reshape(rows // br, br, cols // bc, bc)


def _expand(scales: Tensor, tile: tuple[int, int]) -> Tensor:
    return scales.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)


def quantize(
    x: Tensor,
    fmt: Fp4Format,
    tile: tuple[int, int] | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    whole: Tensor | None = None,
) -> Quantized:
    """`x` (2-D) in FP4 of `fmt`, one scale per `tile` (default: 1 × the format's block, along
    the rows' last dimension, a GEMM's inner one). Non-finite values make their tile's scale NaN,
    so every value dequantized from it is NaN (the run's non-finite guard then sees the step).
    `whole`: the amax of the tensor `x` is a block of rows of (nvfp4's tensor scale is the whole
    tensor's; the matmul-error probe quantizes a block at a time); default x's own."""
    x = x.float()
    tile = tile or (1, fmt.block)
    tiles = _tiles(x, tile)
    amax = tiles.abs().amax(dim=(1, 3))  # NaN where a tile holds one
    finite = torch.isfinite(amax)
    if fmt is NVFP4:
        # torchao's nvfp4_quantize (two-level scaling): the block scale relative to the tensor's,
        # clamped to E4M3's normal range and rounded to it; values times the reciprocal
        whole = x.abs().amax() if whole is None else whole
        tensor_scale = torch.where(whole > 0, whole / (E2M1_MAX * E4M3_MAX), torch.ones_like(whole))
        wanted = amax / E2M1_MAX / tensor_scale
        clamped = wanted > E4M3_MAX * CLIP_TOLERANCE  # past what rounds to 448
        scales = wanted.clamp(E4M3_TINY, E4M3_MAX).to(torch.float8_e4m3fn)
        reciprocal = (1.0 / tensor_scale) / scales.float()
    else:
        # OCP MX v1.0: the shared exponent floor(log2(amax)) − 2, in E8M0's range
        tensor_scale = torch.ones((), device=x.device)
        exponent = torch.frexp(amax)[1] - 1 - E2M1_EMAX
        exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, E8M0_EXPONENTS[0]))
        clamped = exponent > E8M0_EXPONENTS[1]
        scales = torch.exp2(exponent.clamp(*E8M0_EXPONENTS).float()).to(torch.float8_e8m0fnu)
        reciprocal = 1.0 / scales.float()
    scales = torch.where(finite, scales.float(), torch.nan).to(fmt.scale_dtype)
    scaled = x.abs() * _expand(torch.where(finite, reciprocal, torch.nan), tile)
    if stochastic:
        magnitude = e2m1_stochastic(scaled, generator)
    else:
        magnitude = e2m1_round(scaled)
    codes = magnitude | ((x < 0).to(torch.uint8) << 3)
    # beyond ±6 by more than an E4M3 scale's rounding: MX's floor exponent clips up to 8
    peak = _tiles(scaled.nan_to_num(0.0), tile).amax(dim=(1, 3))
    saturated = clamped | ~finite | (peak > E2M1_MAX * CLIP_TOLERANCE)
    underflow = (amax > 0) & (_tiles(magnitude, tile).amax(dim=(1, 3)) == 0)
    return Quantized(codes, scales, tensor_scale, tile, saturated, underflow)


def dequantize(packed: Tensor, scales: Tensor, tensor_scale: Tensor) -> Tensor:
    """The fp32 values of packed FP4 data (rows × cols/2 bytes) and its scales: one per tile,
    the tile's shape read off the two shapes."""
    data = packed.view(torch.uint8)
    codes = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(data.shape[0], -1)
    grid = torch.tensor(E2M1_GRID, device=data.device)
    values = grid[(codes & 7).long()] * (1 - 2 * (codes >> 3).float())
    tile = (codes.shape[0] // scales.shape[0], codes.shape[1] // scales.shape[1])
    return values * _expand(scales.float(), tile) * tensor_scale.float()


def hadamard(signs: Tensor) -> Tensor:
    """The random Hadamard transform: Sylvester's 16×16 Hadamard matrix times diag(signs),
    over 4 (orthonormal: Hᵀ H = I)."""
    h = torch.ones(1, 1)
    while h.shape[0] < signs.numel():
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h * signs / signs.numel() ** 0.5


__all__ = [
    "FORMATS",
    "MXFP4",
    "NVFP4",
    "Quantized",
    "quantize",
]
