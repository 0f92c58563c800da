"""Converted Linears, the machinery every converting mode shares (fp8, mxfp8, nvfp4, mxfp4):
which of the model's `nn.Linear` layers are converted to the mode's format, and why the others
are not, is decided here (`ConvertedLinears`); each format says how a chosen one is converted
(runner/precision/fp8.py's `Float8`, mxfp8.py's `MXFP8`, fp4.py's `Fp4Linears`). What is reported
as converted, and the converted FLOPs, are read off the model (the layers that are the format's
converted class) and off the GEMMs that ran on the format's tensors. In a `staged` run the
converted layers compute in their format only in the stages of their mode."""

from __future__ import annotations

import abc
import contextlib
import functools
import importlib
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from runner import console
from runner.errors import UserError
from runner.precision import fp32_islands, layers, shorthands
from runner.precision.conversion import (
    as_linear,
    carry,
    is_conv1d,
    nothing_converted,
)
from runner.precision.conversion import (
    dims as _dims,
)
from runner.precision.layers import recomputing
from runner.precision.recipe import (
    DIRECTIONS,
    Rule,
    chains,
    defaults,
    first_match,
    unmatched,
)


def import_torchao(module: str, mode: str):
    """A torchao module, imported only when `mode` needs it (torchao is a large import)."""
    console.quiet_torchao()
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"precision={mode} needs torchao (pip install torchao, the release that fits your "
            "torch: 0.18.0 for torch 2.13)"
        ) from None


class ConvertedLinears(abc.ABC):
    """Chooses the Linears to convert (the skip rules of `keys`: precision.fp8 or precision.fp4),
    converts them once (before compile and DDP/FSDP wrapping) and switches them between their
    low-precision forward and their plain one as the run's stages go in and out of the mode. A
    format (`Float8`, `MXFP8`, `Fp4Linears`) says how a layer is converted, what it becomes, and
    its GEMMs' alignment."""

    alignment = 16  # the dimensions (and a gradient GEMM's rows) the format's kernels need
    keys = "precision.fp8"  # where the chooser's keys are (the fp4 formats': precision.fp4)
    compute: str  # the format a rule names (the mode's compute)

    def __init__(self, cfg):
        self.recipe, self.patterns = cfg.recipe, list(cfg.skip)
        self.min_features, self.all_gather = cfg.min_features, cfg.all_gather
        self.keep_bf16 = cfg.keep_bf16.first, cfg.keep_bf16.last
        self.convert_adapters = cfg.convert_adapters
        self.skipped: dict[str, str] = {}
        self.user_rules: list[Rule] = []  # precision.recipe's (runner/precision/recipe.py)
        self.user_default: Rule | None = None  # its `default:`, in place of the mode's
        self.device_type = "cpu"  # whose autocast an fp32 island turns off
        self.rules: list[Rule] = []  # the recipe in force, once the model is known
        self.plan: dict[str, tuple[str, str, str]] = {}  # converted Linear → its directions
        self.plans: list[tuple[int, dict]] = []  # (from step, plan): the autopilot's changes
        # Linear → the rule that decided it (converted, or left out by its rule; not a Linear
        # the format cannot take)
        self.rule_of: dict[str, Rule] = {}
        self.fp32_linears: list[str] = []  # those the recipe's all-fp32 rules make fp32 islands
        self.from_conv1d: list[str] = []  # the converted ones that were GPT-2's Conv1D
        self.active = False
        self._model: nn.Module | None = None
        self._layer: type | None = None  # torchao's converted layer class, once imported
        self._gemm_tensor: type | None = None  # torchao's tensor class of the GEMMs' operands

    @abc.abstractmethod
    def _convert(self, model: nn.Module, chosen: set[str]) -> None:
        """Converts the Linears named in `chosen` with torchao; sets `_layer`, `_gemm_tensor`.
        Each format (`Float8`, `MXFP8`) says how."""

    def _compute(self, layer: nn.Module, low_forward: Callable, x: torch.Tensor) -> torch.Tensor:
        """A converted layer's low-precision forward on `x`, as the format's kernels take it."""
        return low_forward(x)

    def _unfit(self, linear: nn.Module) -> str | None:
        """Why the format cannot convert `linear` (its class, its dimensions), or None."""
        if type(linear) is not nn.Linear and not is_conv1d(linear):
            return f"a {type(linear).__name__}, not a plain nn.Linear"
        dims = _dims(linear)
        if any(d % self.alignment for d in dims):
            return f"dimensions {dims[0]}×{dims[1]} are not multiples of {self.alignment}"
        return None

    def default_formats(self) -> tuple[str, str, str]:
        """The mode's default rule: every direction in its format (runner/precision/recipe.py's
        `defaults`: rowwise_with_gw_hp's weight gradient in bf16)."""
        fp8_recipe = self.recipe if self.compute == "fp8" else "tensorwise"
        return tuple(defaults(self.compute, fp8_recipe).values())

    def follow(self, user: tuple[list[Rule], Rule | None], device: torch.device) -> None:
        """precision.recipe's (rules, default), read by runner/precision/recipe.py's `for_run`,
        on `device`."""
        (self.user_rules, self.user_default), self.device_type = user, device.type

    def prepare(self, model: nn.Module, islands: Iterable[nn.Module]) -> None:
        """Converts each Linear by the first rule that matches it (runner/precision/recipe.py):
        fp32 islands, then precision.recipe's rules, then the shorthands (keep_bf16 blocks, a
        fine-tune's adapters unless `keys`.convert_adapters=true, min_features, skip),
        then the recipe's default, else the mode's; a rule that keeps every direction bf16
        leaves the Linear out, as does a Linear the format cannot take (its class, its
        dimensions); one of the recipe's that keeps every direction fp32 makes it an fp32 island
        (`fp32_linears`), as precision.fp32_modules does. GPT-2's `Conv1D`
        layers (Linears with the weight stored transposed) are chosen by the same rules; a
        chosen one becomes a Linear first, saved in the Conv1D's layout still. A converted
        layer keeps the trainability, hooks and forward layers of the module it replaced
        (`carry`, runner/precision/conversion.py)."""
        linears = [
            (n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)
        ]
        unmatched(self.user_rules, model, [n for n, _ in linears])
        first_rules = shorthands.early(self, model, islands)
        last_rules = shorthands.late(self, linears, _dims)
        self.rules = first_rules + last_rules
        chain_of = chains(model)
        chosen: dict[str, tuple[str, str, str]] = {}
        for name, linear in linears:
            rule = first_match(self.rules, chain_of[name])
            unfit = self._unfit(linear)
            if rule.converts() and not unfit:
                chosen[name] = rule.formats
            else:
                early = rule in first_rules and not rule.converts()
                by_rule = early or not unfit or rule.island()
                self.skipped[name] = rule.reason() if by_rule else unfit
            if not (rule.converts() and unfit):
                self.rule_of[name] = rule
            if rule.island() and (rule in self.user_rules or rule == self.user_default):
                self.fp32_linears.append(name)
        fp32_islands.make([model.get_submodule(n) for n in self.fp32_linears], self.device_type)
        self.plan = chosen
        self._model = model
        console.say(f"recipe in force ({self.keys} shorthands expanded; first match wins):")
        for rule in self.recipe_in_force():
            console.console.print(f"  {rule}", soft_wrap=True, highlight=False, markup=False)
        if not chosen:
            return
        originals = {name: model.get_submodule(name) for name in chosen}
        self.from_conv1d = [name for name, old in originals.items() if is_conv1d(old)]
        for name, old in originals.items():
            if is_conv1d(old):
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, as_linear(old))
        self._convert(model, chosen)
        for name, old in originals.items():
            new = model.get_submodule(name)
            carry(old, new)
            layers.add(new, "converted", self._switch)

    def switch(self, name: str, formats: tuple[str, str, str], step: int, source: str) -> None:
        """From optimizer step `step` on, converted Linear `name` computes `formats`, as if the
        recipe's first rule had said so (the autopilot, runner/precision/autopilot.py); all
        high, it runs as the plain Linear it was. The plan of each step stays known (`plan_at`)."""
        if not self.plans:
            self.plans.append((1, dict(self.plan)))
        self.plan = {**self.plan, name: formats}
        self.plans.append((step, dict(self.plan)))
        self.rule_of[name] = rule = Rule("module", name, formats, source)
        layer = self._model.get_submodule(name)
        layer._plain = not rule.converts()
        self._set(layer, formats)

    def plan_at(self, step: int) -> dict[str, tuple[str, str, str]]:
        """The plan optimizer step `step` ran under."""
        return next((p for since, p in reversed(self.plans) if since <= step), self.plan)

    @abc.abstractmethod
    def _set(self, layer: nn.Module, formats: tuple[str, str, str]) -> None:
        """A converted layer computes `formats` from its next call: each format says how."""

    def recipe_in_force(self) -> list[str]:
        """Every rule in force, first match wins, the shorthands expanded."""
        return [rule.describe() for rule in self.rules]

    def _converted(self) -> dict[str, nn.Module]:
        """The layers that are torchao's converted class (FSDP2 subclasses it), by name."""
        if self._layer is None:
            return {}
        return {n: m for n, m in self._model.named_modules() if isinstance(m, self._layer)}

    def _switch(self, module: nn.Module, forward: Callable, x: torch.Tensor) -> torch.Tensor:
        """The `converted` layer of a converted Linear's forward (runner/precision/layers.py):
        outside the mode's stages it runs as the plain Linear it was (same weights). Under
        `inference_mode` (evaluation) torchao's low-precision tensors fail, so it runs under
        `no_grad`."""
        # `switch`ed to bf16; read with getattr: torch.compile guards on it (a `__dict__` read
        # went unguarded past mxfp8's compile-disabled emulation, and the switch was never seen)
        if not self.active or getattr(module, "_plain", False):
            return nn.Linear.forward(module, x)
        low_forward = functools.partial(self._compute, module, forward)
        if torch.is_inference_mode_enabled():  # evaluation: torchao's tensors need plain no_grad
            with torch.inference_mode(False), torch.no_grad():
                return low_forward(x)
        return _rows_aligned(low_forward, x, self.alignment)

    def after_step(self) -> None:
        """What the format does after each optimizer step (`Float8`'s FSDP2 scales): by default,
        nothing (MXFP8 has no step-to-step state)."""
        return None

    def report(self) -> dict:
        """`converted`: the layers that are torchao's converted class on the model; `skipped`:
        the Linears left out, each with its reason."""
        converted = list(self._converted())
        report = {"recipe": self.recipe, "converted": converted, "skipped": self.skipped}
        report["recipe_in_force"] = self.recipe_in_force()
        report["directions"] = {
            n: dict(zip(DIRECTIONS, f, strict=True)) for n, f in self.plan.items()
        }
        if (
            self.from_conv1d
        ):  # what a user's torchao leaves as it is (runner/answers/recipe_export.py)
            report["from_conv1d"] = self.from_conv1d
        if not converted:  # the mode is bf16 autocast by another name: said, not a silent 1.00×
            report["nothing_converted"] = nothing_converted(self.skipped)
        return report

    @contextlib.contextmanager
    def counting(self) -> Iterator[dict]:
        """The FLOPs of the converted GEMMs of the steps run inside (the audited one): the matmuls
        whose operands are the format's tensors, each of which torchao runs on low-precision data
        (on a CPU too). None outside the mode's stages, where the layers run plain."""
        gemms = _ConvertedGemms(self._gemm_tensor) if self._gemm_tensor else None
        with gemms or contextlib.nullcontext():
            yield gemms.counts if gemms else {"converted_flops_per_step": 0}


class _ConvertedGemms(TorchDispatchMode):
    """Counts the FLOPs of the ops that take a torchao low-precision tensor (`Float8TrainingTensor`,
    MXFP8's `MXTensor`); the tensor turns each matmul into a `_scaled_mm` (or its emulation)
    below this mode, out of its sight. Model FLOPs,
    as the audit's: a forward that gradient checkpointing recomputes is not counted again."""

    def __init__(self, gemm_tensor: type):
        super().__init__()
        self.gemm_tensor = gemm_tensor
        self.counts = {"converted_flops_per_step": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula and not recomputing() and any(issubclass(t, self.gemm_tensor) for t in types):
            self.counts["converted_flops_per_step"] += int(formula(*args, **kwargs, out_val=out))
        return out


def _rows_aligned(low_forward: Callable, x: torch.Tensor, alignment: int) -> torch.Tensor:
    """The layer's low-precision forward with the input's rows (the micro-batch's tokens) padded
    with zero rows to a multiple of `alignment` where they are not (a dataset padded per batch): the
    GEMM of the weight's gradient sums over them, and on a GPU torch._scaled_mm refuses an inner
    dimension that is not a multiple of 16 (torchao's `pad_inner_dim` would copy every GEMM's
    operands, aligned or not); MXFP8 scales that dimension in blocks of 32, on a CPU too. Zero rows
    add nothing to that gradient nor to any scale's amax (a tensor's, a row's or a 32-block's);
    their outputs are dropped."""
    rows = x.numel() // x.shape[-1]
    missing = -rows % alignment
    if not missing or not torch.is_grad_enabled():  # no gradient GEMM in evaluation
        return low_forward(x)
    padded = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, missing))
    return low_forward(padded)[:rows].reshape(*x.shape[:-1], -1)
