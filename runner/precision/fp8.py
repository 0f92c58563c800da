"""Low-precision Linears, fp8 or MXFP8: which of the model's `nn.Linear` layers torchao converts,
and why the others are not, is decided here (`Fp8Linears`, for both formats); `Float8` is
precision=fp8's format, torchao's float8 (runner/precision/mxfp8.py is precision=mxfp8's). What
is reported as converted, and the fp8 FLOPs, are read off the model (the layers that are
torchao's converted class) and off the GEMMs that ran on torchao's fp8 tensors. In a `staged`
run the converted layers compute in fp8 only in the stages of their mode."""

from __future__ import annotations

import abc
import contextlib
import fnmatch
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
from runner.precision import layers
from runner.precision.adapters import adapter_parameters
from runner.precision.conversion import as_linear, carry, is_conv1d, nothing_converted
from runner.precision.layers import recomputing
from runner.task import Task

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
FIRST, LAST = "first", "last"  # in `skip`: the model's first and last Linear layers
ADAPTER = (
    "a fine-tune's adapter (model.peft), left in autocast's dtype (precision.fp8.convert_adapters)"
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


class Fp8Linears(abc.ABC):
    """Chooses the Linears to convert (the skip rules of precision.fp8), converts them once
    (before compile and DDP/FSDP wrapping) and switches them between their low-precision forward
    and their plain one as the run's stages go in and out of the mode. A format (`Float8`,
    `MXFP8`) says how torchao converts a layer, what it becomes, and its GEMMs' alignment."""

    alignment = 16  # the dimensions (and a gradient GEMM's rows) the format's kernels need
    keys = "precision.fp8"  # where the chooser's keys are (fp4's: precision.fp4)

    def __init__(self, cfg):
        self.recipe, self.patterns = cfg.recipe, list(cfg.skip)
        self.min_features, self.all_gather = cfg.min_features, cfg.all_gather
        self.keep_bf16 = cfg.keep_bf16.first, cfg.keep_bf16.last
        self.convert_adapters = cfg.convert_adapters
        self.skipped: dict[str, str] = {}
        self.active = False
        self._model: nn.Module | None = None
        self._layer: type | None = None  # torchao's converted layer class, once imported
        self._gemm_tensor: type | None = None  # torchao's tensor class of the GEMMs' operands

    @abc.abstractmethod
    def _convert(self, model: nn.Module, chosen: set[str]) -> None:
        """Converts the Linears named in `chosen` with torchao; sets `_layer`, `_gemm_tensor`.
        Each format (`Float8`, `MXFP8`) says how."""

    def _compute(self, layer: nn.Module, fp8_forward: Callable, x: torch.Tensor) -> torch.Tensor:
        """A converted layer's low-precision forward on `x`, as the format's kernels take it."""
        return fp8_forward(x)

    def _skip_reason(self, name: str, linear: nn.Module, order: list[str]) -> str | None:
        if is_conv1d(linear):
            dims = tuple(linear.weight.shape)
        elif type(linear) is nn.Linear:
            dims = linear.in_features, linear.out_features
        else:
            return f"a {type(linear).__name__}, not a plain nn.Linear"
        if any(d % self.alignment for d in dims):
            return f"dimensions {dims[0]}×{dims[1]} are not multiples of {self.alignment}"
        if min(dims) < self.min_features:
            return f"smaller than {self.keys}.min_features={self.min_features}"
        for pattern in self.patterns:
            if (pattern == FIRST and name == order[0]) or (pattern == LAST and name == order[-1]):
                return f"the {pattern} Linear layer ({self.keys}.skip)"
            if pattern not in (FIRST, LAST) and fnmatch.fnmatchcase(name, pattern):
                return f"matches {pattern!r} ({self.keys}.skip)"
        return None

    def _kept_blocks(self, model: nn.Module) -> dict[int, str]:
        """id → reason, for the modules in the blocks precision.fp8.keep_bf16 leaves in bf16: the
        first and last of the task's blocks (`Task.shard_units`, those FSDP shards one by one)."""
        first, last = self.keep_bf16
        if not first and not last:
            return {}
        blocks = model.shard_units() if isinstance(model, Task) else []
        if not blocks:  # nvfp4's default keeps the last block: a model without blocks runs on
            console.say(
                f"note: {self.keys}.keep_bf16 keeps no block: the model has none "
                "(no nn.ModuleList or nn.Sequential of blocks)"
            )
            return {}
        if first + last > len(blocks):
            raise UserError(
                f"{self.keys}.keep_bf16: first={first} and last={last} blocks, but the model has "
                f"{len(blocks)} (those FSDP shards: its longest nn.ModuleList or nn.Sequential)"
            )
        kept = {}
        for i, block in enumerate(blocks):
            end = FIRST if i < first else LAST if i >= len(blocks) - last else None
            if end:
                count = first if end == FIRST else last
                why = f"in block {i} of {len(blocks)} ({self.keys}.keep_bf16.{end}={count})"
                kept |= {id(m): why for m in block.modules()}
        return kept

    def prepare(self, model: nn.Module, islands: Iterable[nn.Module]) -> None:
        """Converts every Linear not skipped: Linears inside fp32 islands stay high precision, a
        fine-tune's adapters (model.peft) stay in autocast's dtype unless
        precision.fp8.convert_adapters=true. GPT-2's `Conv1D` layers (Linears with the weight
        stored transposed) are chosen by the same rules; a chosen one becomes a Linear first,
        saved in the Conv1D's layout still. A converted layer keeps the trainability, hooks and
        forward layers of the module it replaced (`carry`, runner/precision/conversion.py)."""
        adapters = set() if self.convert_adapters else adapter_parameters(model)
        # id → reason, by precedence: an island's, then keep_bf16's, then an adapter's
        excluded = {
            **{
                id(m): ADAPTER
                for m in model.modules()
                if not adapters.isdisjoint(m.parameters(False))
            },
            **self._kept_blocks(model),
            **{id(m): "inside an fp32 island" for island in islands for m in island.modules()},
        }
        linears = [
            (n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)
        ]
        order = [n for n, _ in linears]
        chosen: dict[str, nn.Module] = {}
        for name, linear in linears:
            if reason := excluded.get(id(linear)) or self._skip_reason(name, linear, order):
                self.skipped[name] = reason
            else:
                chosen[name] = linear
        self._model = model
        if not chosen:
            return
        for name, old in chosen.items():
            if is_conv1d(old):
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, as_linear(old))
        self._convert(model, set(chosen))
        for name, old in chosen.items():
            new = model.get_submodule(name)
            carry(old, new)
            layers.add(new, "fp8", self._switch)

    def _converted(self) -> dict[str, nn.Module]:
        """The layers that are torchao's converted class (FSDP2 subclasses it), by name."""
        if self._layer is None:
            return {}
        return {n: m for n, m in self._model.named_modules() if isinstance(m, self._layer)}

    def _switch(self, module: nn.Module, forward: Callable, x: torch.Tensor) -> torch.Tensor:
        """The `fp8` layer of a converted Linear's forward (runner/precision/layers.py): outside
        the mode's stages it runs as the plain Linear it was (same weights). Under
        `inference_mode` (evaluation) torchao's fp8 tensors fail, so it runs under `no_grad`."""
        if not self.active:
            return nn.Linear.forward(module, x)
        fp8_forward = functools.partial(self._compute, module, forward)
        if torch.is_inference_mode_enabled():  # evaluation: torchao's fp8 needs plain no_grad
            with torch.inference_mode(False), torch.no_grad():
                return fp8_forward(x)
        return _rows_aligned(fp8_forward, x, self.alignment)

    def after_step(self) -> None:
        """What the format does after each optimizer step (fp8's FSDP2 scales): by default,
        nothing (MXFP8 has no step-to-step state)."""
        return None

    def report(self) -> dict:
        """`converted`: the layers that are torchao's converted class on the model; `skipped`:
        the Linears left out, each with its reason."""
        converted = list(self._converted())
        report = {"recipe": self.recipe, "converted": converted, "skipped": self.skipped}
        if not converted:  # the mode is bf16 autocast by another name: said, not a silent 1.00×
            report["nothing_converted"] = nothing_converted(self.skipped)
        return report

    @contextlib.contextmanager
    def counting(self) -> Iterator[dict]:
        """The FLOPs of the fp8 GEMMs of the steps run inside (the audited one): the matmuls
        whose operands are torchao's fp8 tensors, each of which torchao runs on fp8 data (on a
        CPU too). None outside the mode's stages, where the layers run plain."""
        gemms = _Fp8Gemms(self._gemm_tensor) if self._gemm_tensor else None
        with gemms or contextlib.nullcontext():
            yield gemms.counts if gemms else {"fp8_flops_per_step": 0}


class Float8(Fp8Linears):
    """precision=fp8: torchao's float8 training (`convert_to_float8_training`: `Float8Linear`
    layers with dynamic scales, in one of its recipes)."""

    def __init__(self, cfg):
        if cfg.recipe not in RECIPES:
            raise UserError(
                f"precision.fp8.recipe={cfg.recipe!r} is invalid: allowed: {', '.join(RECIPES)}"
            )
        super().__init__(cfg)
        self._float8 = None  # torchao.float8, once imported (only where a layer is chosen)

    def _convert(self, model: nn.Module, chosen: set[str]) -> None:
        self._float8 = float8 = import_torchao("torchao.float8", "fp8")
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        if self.all_gather:
            if self.recipe != "tensorwise":
                raise UserError(
                    "precision.fp8.all_gather=true needs precision.fp8.recipe=tensorwise "
                    "(torchao gathers fp8 weights with one scale per tensor)"
                )
            config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        float8.convert_to_float8_training(
            model, config=config, module_filter_fn=lambda _module, fqn: fqn in chosen
        )
        self._layer = import_torchao("torchao.float8.float8_linear", "fp8").Float8Linear
        self._gemm_tensor = float8.Float8TrainingTensor

    def _compute(self, layer: nn.Module, fp8_forward: Callable, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            # as torchao does under CUDA's autocast only: on a CPU the input stayed fp32
            # (rowwise_with_gw_hp's high-precision GEMM then met a bf16 gradient and failed)
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return fp8_forward(x)

    def after_step(self) -> None:
        """With fp8 all-gather under FSDP2: the next gather's scales, one collective for all."""
        if self.all_gather and self.active and self._float8:
            self._float8.precompute_float8_dynamic_scale_for_fsdp(self._model)


class _Fp8Gemms(TorchDispatchMode):
    """Counts the FLOPs of the ops that take a torchao fp8 tensor (`Float8TrainingTensor`,
    MXFP8's `MXTensor`); the tensor turns each matmul into a `_scaled_mm` (or its emulation)
    below this mode, out of its sight. Model FLOPs,
    as the audit's: a forward that gradient checkpointing recomputes is not counted again."""

    def __init__(self, fp8_tensor: type):
        super().__init__()
        self.fp8_tensor = fp8_tensor
        self.counts = {"fp8_flops_per_step": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula and not recomputing() and any(issubclass(t, self.fp8_tensor) for t in types):
            self.counts["fp8_flops_per_step"] += int(formula(*args, **kwargs, out_val=out))
        return out


def _rows_aligned(fp8_forward: Callable, x: torch.Tensor, alignment: int) -> torch.Tensor:
    """The layer's fp8 forward with the input's rows (the micro-batch's tokens) padded with zero
    rows to a multiple of `alignment` where they are not (a dataset padded per batch): the GEMM
    of the weight's gradient sums over them, and on a GPU torch._scaled_mm refuses an inner
    dimension that is not a multiple of 16 (torchao's `pad_inner_dim` would copy every GEMM's
    operands, aligned or not); MXFP8 scales that dimension in blocks of 32, on a CPU too. Zero
    rows add nothing to that gradient nor to any scale's amax (a tensor's, a row's or a 32-block's);
    their outputs are dropped."""
    rows = x.numel() // x.shape[-1]
    missing = -rows % alignment
    if not missing or not torch.is_grad_enabled():  # no gradient GEMM in evaluation
        return fp8_forward(x)
    padded = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, missing))
    return fp8_forward(padded)[:rows].reshape(*x.shape[:-1], -1)
