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
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from runner.precision.fp4_mm import FP4_MM, _mm
from runner.precision.fp4_quant import (
    HADAMARD_SIZE,
    Fp4Format,
    Quantized,
    hadamard,
    quantize,
)
from runner.precision.fp8 import Fp8Linears
from runner.precision.layers import recomputing

# --- the recipe ----------------------------------------------------------------------------


@dataclass
class Recipe:
    """One run's FP4 recipe: the format and its switches, the run's random Hadamard transform
    and this rank's stochastic rounding generators (one per device, seeded from the seed and the
    rank, their states checkpointed: `sr_state`), and the tiles' health counts (per module class
    and tensor: blocks, saturated, underflow). Shared, not copied, by a deep copy of the model."""

    fmt: Fp4Format
    weight_2d: bool = True
    rht: bool = True
    sr: bool = True
    quantize: bool = True  # off: the recipe's transforms without its rounding (tests)
    seed: int = 0
    rank: int = 0  # under DDP/FSDP each rank rounds with its own stream
    counts: dict = field(default_factory=lambda: defaultdict(lambda: torch.zeros(3)))
    _rht: Tensor | None = None
    _generators: dict = field(default_factory=dict)
    _saved: dict = field(default_factory=dict)  # a checkpoint's states, for devices not yet used

    def __deepcopy__(self, memo) -> Recipe:
        return self

    def transform(self) -> Tensor:
        if self._rht is None:
            g = torch.Generator().manual_seed(self.seed)
            signs = torch.randint(0, 2, (HADAMARD_SIZE,), generator=g).float() * 2 - 1
            self._rht = hadamard(signs)
        return self._rht

    def generator(self, device: torch.device) -> torch.Generator:
        """The device's stochastic rounding generator: as a checkpoint left it, else seeded."""
        key = str(device)
        if key not in self._generators:
            g = torch.Generator(device=device).manual_seed(sr_seed(self.seed, self.rank))
            if (saved := self._saved.pop(key, None)) is not None:
                g.set_state(saved)
            self._generators[key] = g
        return self._generators[key]

    def sr_state(self) -> dict[str, Tensor]:
        """The generators' states by device, for a checkpoint (runner/train/checkpoint.py)."""
        return self._saved | {key: g.get_state() for key, g in self._generators.items()}

    def load_sr_state(self, states: dict[str, Tensor]) -> None:
        """A checkpoint's `sr_state` (this rank's): each device's generator continues from it."""
        self._generators.clear()
        self._saved = dict(states)

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


def sr_seed(seed: int, rank: int) -> int:
    """The stochastic rounding generators' seed: rank 0's is one process's (seed + 1), the other
    ranks' apart in their low 32 bits (all a CPU generator's Mersenne Twister keeps), by an odd
    step (2³²/φ): no two ranks of a run draw the same stream."""
    return seed + 1 + rank * 0x9E3779B9


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
            rank=dist.get_rank() if dist.is_available() and dist.is_initialized() else 0,
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
        """fp8's report and the recipe's; the tiles' health is measure's to read off
        `recipe.counts` (runner/measure/health.py's `fp4_health`)."""
        r = self.recipe
        return super().report() | {
            "recipe": self.recipe_name,
            "format": self.fmt.name,
            "weight_2d": r.weight_2d,
            "rht": r.rht,
            "sr": r.sr,
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
    "Fp4Linear",
    "Fp4Linears",
]
