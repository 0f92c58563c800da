"""FP4 Linears, emulated: precision=nvfp4 and precision=mxfp4 on any device. The Linears are
chosen by fp8's chooser (`Fp8Linears`: skip rules, keep_bf16 blocks, fp32 islands, LoRA's
adapters left out, GPT-2's Conv1D converted keeping its trainability, hooks and saved layout),
read from precision.fp4; each chosen one becomes an `Fp4Linear` whose three GEMMs quantize their
operands as the hardware rounds them (E2M1 values in blocks along each GEMM's inner dimension)
and multiply the dequantized values in fp32:

- forward  y  = q(x) q(W)ᵀ
- dgrad    dx = q(dy) q(W)            (precision.fp4.weight_2d: W quantized once, in 16×16 tiles,
                                       so forward and backward multiply the same quantized W)
- wgrad    dW = q(H dy)ᵀ q(H x)       (precision.fp4.rht: H a 16×16 random Hadamard transform
                                       along the tokens, one random sign vector per run)

with the gradient dy stochastically rounded into FP4 where precision.fp4.sr is on. The formats:

- NVFP4: blocks of 16, an E4M3 scale per block and an FP32 scale per tensor (the tensor's amax
  maps to 6 × 448, E2M1's and E4M3's largest values), as arXiv 2509.25149 and torchao's NVFP4Tensor;
- MXFP4 (OCP Microscaling v1.0): blocks of 32, an E8M0 (power-of-two) scale per block,
  2^(floor(log2 amax) − 2), values beyond ±6 saturate; round to nearest, even on ties.

Each GEMM is one op the dispatcher sees, `amp_runner::fp4_mm`, whose operands are the packed FP4
data (torch.float4_e2m1fn_x2, two values a byte) and the scales: the precision manifest reads the
format off them (runner/measure/manifest.py), and the FLOP counter has its formula. No FP4 kernel
runs: the numerics are the hardware's, the speed is the emulation's."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import register_flop_formula

from runner.precision.fp8 import Fp8Linears
from runner.precision.layers import recomputing

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
) -> Quantized:
    """`x` (2-D) in FP4 of `fmt`, one scale per `tile` (default: 1 × the format's block, along
    the rows' last dimension, a GEMM's inner one). Non-finite values make their tile's scale NaN,
    so every value dequantized from it is NaN (the run's non-finite guard then sees the step)."""
    x = x.float()
    tile = tile or (1, fmt.block)
    tiles = _tiles(x, tile)
    amax = tiles.abs().amax(dim=(1, 3))  # NaN where a tile holds one
    finite = torch.isfinite(amax)
    if fmt is NVFP4:
        # torchao's nvfp4_quantize (two-level scaling): the block scale relative to the tensor's,
        # clamped to E4M3's normal range and rounded to it; values times the reciprocal
        whole = x.abs().amax()
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


# --- the GEMM the dispatcher sees ----------------------------------------------------------


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


@register_flop_formula(torch.ops.amp_runner.fp4_mm)
def _fp4_mm_flops(a_shape, _as, _at, b_shape, *_args, out_shape=None, **_kwargs) -> int:
    return 2 * a_shape[0] * b_shape[0] * a_shape[1] * 2  # two E2M1 values a byte


FP4_MM = torch.ops.amp_runner.fp4_mm


def _mm(a: Quantized, b: Quantized, roles: str) -> Tensor:
    return FP4_MM(a.packed(), a.scales, a.tensor_scale, b.packed(), b.scales, b.tensor_scale, roles)


# --- the recipe ----------------------------------------------------------------------------


def hadamard(signs: Tensor) -> Tensor:
    """The random Hadamard transform: Sylvester's 16×16 Hadamard matrix times diag(signs),
    over 4 (orthonormal: Hᵀ H = I)."""
    h = torch.ones(1, 1)
    while h.shape[0] < signs.numel():
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h * signs / signs.numel() ** 0.5


@dataclass
class Recipe:
    """One run's FP4 recipe: the format and its switches, the run's random Hadamard transform
    and stochastic rounding generator, and the tiles' health counts (per module class and
    tensor: blocks, saturated, underflow). Shared, not copied, by a deep copy of the model."""

    fmt: Fp4Format
    weight_2d: bool = True
    rht: bool = True
    sr: bool = True
    quantize: bool = True  # off: the recipe's transforms without its rounding (tests)
    seed: int = 0
    counts: dict = field(default_factory=lambda: defaultdict(lambda: torch.zeros(3)))
    _rht: Tensor | None = None
    _generators: dict = field(default_factory=dict)

    def __deepcopy__(self, memo) -> Recipe:
        return self

    def transform(self) -> Tensor:
        if self._rht is None:
            g = torch.Generator().manual_seed(self.seed)
            signs = torch.randint(0, 2, (HADAMARD_SIZE,), generator=g).float() * 2 - 1
            self._rht = hadamard(signs)
        return self._rht

    def generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed + 1)
        return self._generators[key]

    def q(self, x: Tensor, kind: str, tensor: str, tile=None, stochastic=False) -> Quantized:
        """`x` quantized, its tiles' health counted under (module class, tensor)."""
        if not self.quantize:
            return _exact(x, tile or (1, self.fmt.block))
        gen = self.generator(x.device) if stochastic else None
        out = quantize(x, self.fmt, tile, stochastic, gen)
        if not recomputing():
            counts = torch.stack(
                (
                    torch.tensor(float(out.saturated.numel()), device=x.device),
                    out.saturated.sum().float(),
                    out.underflow.sum().float(),
                )
            )
            key = (kind, tensor)
            self.counts[key] = self.counts[key].to(x.device) + counts
        return out

    def rotate(self, t: Tensor) -> Tensor:
        """H applied along the rows (tokens) of `t`, 16 at a time: the signs, then the fast
        Walsh-Hadamard transform's butterflies (adds and subtracts, as a kernel fuses it into
        the quantization: no matmul for the manifest to see), over 4."""
        rows, cols = t.shape
        signs = self.transform()[0].sign().to(t.device)  # Sylvester's first row is all ones
        x = t.reshape(rows // HADAMARD_SIZE, HADAMARD_SIZE, cols) * signs[:, None]
        h = 1
        while h < HADAMARD_SIZE:
            x = x.reshape(x.shape[0], HADAMARD_SIZE // (2 * h), 2, h, cols)
            x = torch.stack((x[:, :, 0] + x[:, :, 1], x[:, :, 0] - x[:, :, 1]), dim=2)
            h *= 2
        return x.reshape(rows, cols) / HADAMARD_SIZE**0.5


class _Exact(Quantized):
    """Values kept as they are (Recipe.quantize off), for the transforms' own tests."""

    def packed(self):
        raise RuntimeError("exact values are not packed")


def _exact(x: Tensor, tile) -> Quantized:
    return _Exact(x.float(), torch.ones(1, 1), torch.ones(()), tile)


def _matmul(a: Quantized, b: Quantized, roles: str) -> Tensor:
    if isinstance(a, _Exact):
        return a.codes @ b.codes.t()
    return _mm(a, b, roles)


class _Fp4Linear(torch.autograd.Function):
    """The three GEMMs of an FP4 Linear (no bias): x (tokens × in), weight (out × in)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, recipe: Recipe, kind: str) -> Tensor:
        block = recipe.fmt.block
        w_tile = (block, block) if recipe.weight_2d else (1, block)
        qw = recipe.q(weight, kind, "weight", w_tile)
        y = _matmul(recipe.q(x, kind, "input"), qw, "x,w")
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.kind = recipe, kind
        ctx.qw = qw if recipe.weight_2d else None
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight = ctx.saved_tensors
        recipe, kind = ctx.recipe, ctx.kind
        dy = dy.float()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qdy = recipe.q(dy, kind, "grad_output", stochastic=recipe.sr)
            qwt = ctx.qw.t() if ctx.qw is not None else recipe.q(weight.t(), kind, "weight")
            dx = _matmul(qdy, qwt, "dy,w").to(x.dtype)
        if ctx.needs_input_grad[1]:
            g, a = (recipe.rotate(dy), recipe.rotate(x.float())) if recipe.rht else (dy, x)
            qg = recipe.q(g.t(), kind, "grad_output", stochastic=recipe.sr)
            qa = recipe.q(a.t(), kind, "input")
            dw = _matmul(qg, qa, "dy,x").to(weight.dtype)
        ctx.qw = None
        return dx, dw, None, None


class Fp4Linear(nn.Linear):
    """An nn.Linear whose GEMMs compute in FP4 (emulated); the weights are the Linear's own."""

    recipe: Recipe
    replaced: str = "Linear"  # the class of the module it replaced (health's module class)

    @torch.compiler.disable  # the emulation is there for its numerics, not its speed
    def forward(self, x: Tensor) -> Tensor:
        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        out_dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
        with torch.autocast(device, enabled=False):
            flat = x.reshape(-1, x.shape[-1])
            y = _Fp4Linear.apply(flat, self.weight, self.recipe, self.replaced)
            if self.bias is not None:
                y = y + self.bias
        return y.to(out_dtype).reshape(*x.shape[:-1], -1)


class Fp4Linears(Fp8Linears):
    """precision=nvfp4 / mxfp4: fp8's chooser (runner/precision/fp8.py) on precision.fp4's keys,
    the chosen Linears becoming `Fp4Linear`s of the run's `Recipe`."""

    keys = "precision.fp4"

    def __init__(self, cfg, fmt: Fp4Format):
        super().__init__(cfg)
        self.fmt = fmt
        self.alignment = max(fmt.block, HADAMARD_SIZE)
        self.recipe = Recipe(fmt)
        self.recipe_name = f"{fmt.name} emulated"

    def configure(self, fp4) -> None:
        """Reads precision.fp4 (the chooser's keys and the recipe's switches)."""
        self.patterns, self.min_features = list(fp4.skip), fp4.min_features
        self.keep_bf16 = fp4.keep_bf16.first, fp4.keep_bf16.last
        self.convert_adapters = fp4.convert_adapters
        self.recipe = Recipe(
            self.fmt,
            weight_2d=fp4.weight_2d,
            rht=fp4.rht,
            sr=fp4.sr,
            seed=torch.initial_seed() % 2**62,
        )

    def prepare(self, model: nn.Module, islands) -> None:
        classes = {n: type(m).__name__ for n, m in model.named_modules()}  # before Conv1D → Linear
        super().prepare(model, islands)
        for name, layer in self._converted().items():
            layer.replaced = classes.get(name, "Linear")
        self.skipped = {
            name: why.replace("precision.fp8.", f"{self.keys}.")
            for name, why in self.skipped.items()
        }

    def _convert(self, model: nn.Module, chosen: set[str]) -> None:
        for name in chosen:
            parent, _, child = name.rpartition(".")
            old = model.get_submodule(name)
            new = Fp4Linear(
                old.in_features, old.out_features, bias=old.bias is not None, device="meta"
            )
            new.weight, new.bias = old.weight, old.bias
            new.recipe = self.recipe
            setattr(model.get_submodule(parent) if parent else model, child, new)
        self._layer = Fp4Linear

    def report(self) -> dict:
        from runner.measure.health import fp4_health

        r = self.recipe
        return super().report() | {
            "recipe": self.recipe_name,
            "format": self.fmt.name,
            "kernels": "emulated",  # no FP4 kernel runs: quantize, dequantize, multiply in fp32
            "weight_2d": r.weight_2d,
            "rht": r.rht,
            "sr": r.sr,
            "fp4_health": fp4_health(r.counts, self.fmt),
        }

    @contextlib.contextmanager
    def counting(self) -> Iterator[dict]:
        gemms = _Fp4Gemms()
        with gemms:
            yield gemms.counts


class _Fp4Gemms(TorchDispatchMode):
    """The FLOPs of the step's `amp_runner::fp4_mm` ops (model FLOPs: a recomputed forward is not
    counted again), in the key the summary's fp8 block reads."""

    def __init__(self):
        super().__init__()
        self.counts = {"fp8_flops_per_step": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._overloadpacket is FP4_MM and not recomputing():
            a, b = args[0], args[3]
            self.counts["fp8_flops_per_step"] += 4 * a.shape[0] * b.shape[0] * a.shape[1]
        return out


__all__ = [
    "FORMATS",
    "MXFP4",
    "NVFP4",
    "Fp4Linear",
    "Fp4Linears",
    "Quantized",
    "fp4_mm",
    "quantize",
]
