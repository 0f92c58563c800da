"""FP4 Linears, emulated: precision=nvfp4 and precision=mxfp4 on any device. The Linears are
chosen by the converting modes' chooser (`ConvertedLinears`: skip rules, keep_bf16 blocks, fp32
islands, LoRA's adapters left out, GPT-2's Conv1D converted keeping its trainability, hooks and
saved layout), read from precision.fp4; each chosen one becomes an `Fp4Linear` whose three
GEMMs quantize their operands as the hardware rounds them (E2M1 values in blocks along each
GEMM's inner dimension) and multiply the dequantized values in fp32:

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
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from runner.precision.converted import ConvertedLinears
from runner.precision.fp4_mm import FP4_MM
from runner.precision.fp4_quant import HADAMARD_SIZE, Fp4Format
from runner.precision.fp4_rounding import Recipe, _matmul, high_mm, sr_seed
from runner.precision.layers import recomputing
from runner.precision.recipe import HIGH

LOW = ("fp4", "fp4", "fp4")  # every direction in the run's FP4 format


class _Fp4Linear(torch.autograd.Function):
    """The three GEMMs of an FP4 Linear (no bias): x (tokens × in), weight (out × in), each in
    FP4 or, where the layer's recipe rule keeps its direction high, in bf16 or fp32 from the
    unquantized operands (`formats`: forward, input_grad, weight_grad)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, recipe: Recipe, kind: str, formats=LOW) -> Tensor:
        block = recipe.fmt.block
        w_tile = (block, block) if recipe.weight_2d else (1, block)
        quantized_w = recipe.weight_2d and formats[1] not in HIGH  # shared with input_grad
        qw = (
            recipe.q(weight, kind, "weight", w_tile)
            if quantized_w or formats[0] not in HIGH
            else None
        )
        if formats[0] in HIGH:
            y = high_mm(x, weight, formats[0])
        else:
            y = _matmul(recipe.q(x, kind, "input"), qw, "x,w")
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.kind, ctx.formats = recipe, kind, formats
        ctx.qw = qw if quantized_w else None
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight = ctx.saved_tensors
        recipe, kind, (_, dgrad, wgrad) = ctx.recipe, ctx.kind, ctx.formats
        dy = dy.float()
        dx = dw = None
        if ctx.needs_input_grad[0] and dgrad in HIGH:
            dx = high_mm(dy, weight.t(), dgrad).to(x.dtype)
        elif ctx.needs_input_grad[0]:
            qdy = recipe.q(dy, kind, "grad_output", stochastic=recipe.sr)
            qwt = ctx.qw.t() if ctx.qw is not None else recipe.q(weight.t(), kind, "weight")
            dx = _matmul(qdy, qwt, "dy,w").to(x.dtype)
        if ctx.needs_input_grad[1] and wgrad in HIGH:
            dw = high_mm(dy.t(), x.t(), wgrad).to(weight.dtype)
        elif ctx.needs_input_grad[1]:
            g, a = (recipe.rotate(dy), recipe.rotate(x.float())) if recipe.rht else (dy, x)
            qg = recipe.q(g.t(), kind, "grad_output", stochastic=recipe.sr)
            qa = recipe.q(a.t(), kind, "input")
            dw = _matmul(qg, qa, "dy,x").to(weight.dtype)
        ctx.qw = None
        return dx, dw, None, None, None


class Fp4Linear(nn.Linear):
    """An nn.Linear whose GEMMs compute in FP4 (emulated); the weights are the Linear's own."""

    recipe: Recipe
    formats: tuple[str, str, str] = LOW  # per direction: FP4, or a recipe rule's bf16/fp32
    replaced: str = "Linear"  # the class of the module it replaced (health's module class)

    @torch.compiler.disable  # the emulation is there for its numerics, not its speed
    def forward(self, x: Tensor) -> Tensor:
        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        out_dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
        with torch.autocast(device, enabled=False):
            flat = x.reshape(-1, x.shape[-1])
            y = _Fp4Linear.apply(flat, self.weight, self.recipe, self.replaced, self.formats)
            if self.bias is not None:
                y = y + self.bias
        return y.to(out_dtype).reshape(*x.shape[:-1], -1)


class Fp4Linears(ConvertedLinears):
    """precision=nvfp4 / mxfp4: the converting modes' chooser (runner/precision/converted.py) on
    precision.fp4's keys, the chosen Linears becoming `Fp4Linear`s of the run's `Recipe`."""

    keys = "precision.fp4"

    def __init__(self, cfg, fmt: Fp4Format):
        super().__init__(cfg)
        self.fmt, self.compute = fmt, fmt.name
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

    def _convert(self, model: nn.Module, chosen: dict[str, tuple[str, str, str]]) -> None:
        for name, formats in chosen.items():
            parent, _, child = name.rpartition(".")
            old = model.get_submodule(name)
            new = Fp4Linear(
                old.in_features, old.out_features, bias=old.bias is not None, device="meta"
            )
            new.weight, new.bias = old.weight, old.bias
            new.recipe, new.formats = self.recipe, formats
            setattr(model.get_submodule(parent) if parent else model, child, new)
        self._layer = Fp4Linear

    def _set(self, layer: nn.Module, formats: tuple[str, str, str]) -> None:
        layer.formats = formats

    def report(self) -> dict:
        """The chooser's report and the recipe's; the tiles' health is measure's to read off
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
    counted again), in the key the summary's `converted` section reads."""

    def __init__(self):
        super().__init__()
        self.counts = {"converted_flops_per_step": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._overloadpacket is FP4_MM and not recomputing():
            a, b = args[0], args[3]
            self.counts["converted_flops_per_step"] += 4 * a.shape[0] * b.shape[0] * a.shape[1]
        return out


__all__ = ["Fp4Linear", "Fp4Linears", "Recipe", "sr_seed"]
