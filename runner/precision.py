"""Everything about numeric precision lives here: which mode runs, autocast, the GradScaler,
TF32, and the order of an optimizer step (unscale → measure → clip → step → update).

The training loop calls `autocast()`, `backward()` and `step()`; it never touches `torch.amp`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from runner.config import LOSS_SCALED_MODES
from runner.errors import UserError

AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def compute_mode(mode: str) -> str:
    """The arithmetic a mode runs in: fp16_master computes in fp16."""
    return "fp16" if mode == "fp16_master" else mode


NORM_LAYERS = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._NormBase)


@dataclass(frozen=True)
class DeviceCaps:
    """What a device can do natively, as far as precision is concerned."""

    type: str  # "cpu" | "cuda" | "mps"
    name: str
    cuda_capability: tuple[int, int] | None = None
    cpu_flags: frozenset[str] = frozenset()

    @classmethod
    def probe(cls, device: torch.device) -> DeviceCaps:
        if device.type == "cuda":
            return cls(
                "cuda",
                torch.cuda.get_device_name(device),
                cuda_capability=torch.cuda.get_device_capability(device),
            )
        if device.type == "cpu":
            return cls("cpu", _cpu_name(), cpu_flags=_cpu_flags())
        return cls(device.type, device.type)

    def support(self, mode: str) -> tuple[bool, str]:
        """(native, why) for a mode on this device."""
        if mode == "fp32":
            return True, "fp32 runs everywhere"
        if self.type == "cuda":
            cc = self.cuda_capability or (0, 0)
            need = {"tf32": (8, 0), "bf16": (8, 0), "fp16": (7, 0)}[mode]
            ok = cc >= need
            return ok, (
                f"{self.name} has compute capability {cc[0]}.{cc[1]}; "
                f"{mode} tensor cores need ≥ {need[0]}.{need[1]}"
            )
        if self.type == "cpu":
            if mode == "tf32":
                return False, "CPUs have no TF32 units: tf32 matmuls run as fp32"
            flags = {"bf16": ("amx_bf16", "avx512_bf16"), "fp16": ("amx_fp16", "avx512_fp16")}[mode]
            found = [f for f in flags if f in self.cpu_flags]
            if found:
                return True, f"CPU has {', '.join(f.upper() for f in found)}"
            return False, f"CPU lacks {' and '.join(f.upper() for f in flags)}: {mode} is emulated"
        return mode in ("fp16", "bf16"), f"{self.type} autocast"

    def best_mode(self) -> tuple[str, str]:
        """The mode `auto` picks: bf16 (no loss scaling needed) > fp16 > fp32."""
        candidates = ("bf16", "fp16") if self.type == "cuda" else ("bf16",)
        for mode in candidates:
            native, why = self.support(mode)
            if native:
                return mode, why
        return "fp32", f"no native low-precision support on {self.name}"


def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


@dataclass
class StepResult:
    """What one optimizer step did. All tensors stay on the device: reading them is the trainer's
    choice of when to wait for the device."""

    grad_norm: torch.Tensor  # unscaled, before clipping
    skipped: torch.Tensor  # 1.0 where the step changed no weight (non-finite loss or gradients)
    loss_scale: torch.Tensor  # the scale the step's gradients were computed with (1.0: none)


def steps_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Fused optimizers take the skip flag as a tensor and skip on the device: no host read."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class Precision:
    """The precision in force on one device: resolves `auto`, checks support, owns the scaler,
    follows a `staged` schedule step by step, and keeps fp16_master's fp32 master weights."""

    def __init__(
        self, cfg, device: torch.device, caps: DeviceCaps | None = None, sharded: bool = False
    ):
        """`sharded`: gradients are FSDP shards, so fp16 needs a scaler that agrees over ranks."""
        self.caps = caps or DeviceCaps.probe(device)
        self.sharded = sharded
        self.cfg = cfg
        self.requested = cfg.mode
        self.device = device
        self.warnings: list[str] = []
        plan = (
            [(s.until_step, s.mode) for s in cfg.stages]
            if cfg.mode == "staged"
            else [(None, cfg.mode)]
        )
        # (until_step, mode, why) per stage; one stage unless staged
        self.stages = [(until, *self._resolve(mode)) for until, mode in plan]
        self.name = "staged" if cfg.mode == "staged" else self.stages[0][1]
        self.scaler: torch.amp.GradScaler | None = None
        self._masters: dict[torch.nn.Parameter, torch.nn.Parameter] = {}  # model param → fp32
        self._saved_matmul_precision = torch.get_float32_matmul_precision()
        self._saved_cudnn_tf32 = torch.backends.cudnn.allow_tf32
        self._no_scale = torch.ones((), device=device)
        self.mode = ""
        self._enter(*self.stages[0][1:])

    def _resolve(self, mode: str) -> tuple[str, str]:
        """(mode, why): `auto` decided, and a mode the device lacks refused or warned about."""
        if mode == "auto":
            return self.caps.best_mode()
        native, why = self.caps.support(compute_mode(mode))
        if not native:
            # CPUs run bf16/fp16 autocast in software; PyTorch accepts it, so it is a warning.
            # On a GPU without the units the answer to "is it faster" is a foregone no.
            if self.caps.type == "cuda" and not self.cfg.allow_emulated:
                raise UserError(
                    f"precision={mode} is not supported natively here: {why} "
                    "(use precision=auto or fp32, or precision.allow_emulated=true)"
                )
            self.warnings.append(why)
        return mode, why

    def _enter(self, mode: str, reason: str) -> None:
        self.mode, self.reason = mode, reason
        self.dtype = AUTOCAST_DTYPES.get(compute_mode(mode))
        if mode not in LOSS_SCALED_MODES:
            self.scaler = None
        elif self.scaler is None:  # an fp16 stage after another one keeps its scale
            gs = self.cfg.grad_scaler
            scaler = torch.amp.GradScaler
            if self.sharded:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as scaler
            self.scaler = scaler(
                self.device.type,
                init_scale=gs.init_scale,
                growth_factor=gs.growth_factor,
                backoff_factor=gs.backoff_factor,
                growth_interval=gs.growth_interval,
            )
        # Explicit either way: a previous stage or job in this process may have left "high".
        tf32 = mode == "tf32"
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32

    def at_step(self, step: int) -> bool:
        """Enters the stage that covers the optimizer step after `step` steps; True if the mode
        changed."""
        _, mode, reason = next(st for st in self.stages if st[0] is None or step < st[0])
        if mode == self.mode:
            return False
        self._enter(mode, reason)
        return True

    def close(self) -> None:
        """Restore the process-wide matmul settings (a multirun runs many jobs in one process)."""
        torch.set_float32_matmul_precision(self._saved_matmul_precision)
        torch.backends.cudnn.allow_tf32 = self._saved_cudnn_tf32

    def prepare(self, model: torch.nn.Module, fp32_modules: Sequence[str] = ()) -> None:
        """fp16_master: the model's weights become fp16 (norm layers and fp32 islands stay fp32)
        and an fp32 master copy of each, taken before the cast, is what the optimizer updates."""
        if self.mode != "fp16_master":
            return
        modules = dict(model.named_modules())
        kept = {p for name in fp32_modules for p in modules[name].parameters()}
        for module in model.modules():
            if isinstance(module, NORM_LAYERS):
                continue
            for param in module.parameters(recurse=False):
                if param.dtype == torch.float32 and param not in kept | self._masters.keys():
                    master = torch.nn.Parameter(param.detach().clone())
                    param.data = param.data.half()
                    self._masters[param] = master

    def optimizer_groups(self, groups: dict[str, list]) -> dict[str, list]:
        """The parameters the optimizers update: the fp32 masters where there are any."""
        return {name: [self._masters.get(p, p) for p in params] for name, params in groups.items()}

    @property
    def peak_mode(self) -> str:
        """The mode whose peak rate the device's MFU is measured against."""
        return compute_mode(self.mode)

    def memory(self, model: torch.nn.Module) -> dict:
        def mb(params) -> float:
            return sum(p.numel() * p.element_size() for p in params) / 2**20

        return {
            "weights_mb": mb(model.parameters()),
            "master_weights_mb": mb(self._masters.values()),
        }

    def autocast(self) -> contextlib.AbstractContextManager:
        """Wraps forward and loss only. Inputs stay fp32; weights stay fp32 (no .half())."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def keep_fp32(self, model: torch.nn.Module, names: Sequence[str]) -> None:
        """fp32 islands: the named submodules run with autocast disabled and their floating
        inputs cast to fp32. Nothing to do where nothing is autocast."""
        modules = dict(model.named_modules())
        for name in names:
            if name not in modules:
                known = ", ".join(n for n in list(modules)[1:6])
                raise UserError(
                    f"precision.fp32_modules: the model has no module {name!r} (names look like: {known}, ...)"
                )
            if self.dtype is not None:
                modules[name].register_forward_pre_hook(self._enter_fp32, with_kwargs=True)
                modules[name].register_forward_hook(self._exit_fp32, always_call=True)

    def _enter_fp32(self, module, args, kwargs):
        island = torch.autocast(device_type=self.device.type, enabled=False)
        island.__enter__()
        module.__dict__.setdefault("_fp32_islands", []).append(island)

        def cast(x):
            return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    def _exit_fp32(self, module, args, output):
        module.__dict__["_fp32_islands"].pop().__exit__(None, None, None)

    def backward(self, losses: Sequence[torch.Tensor]) -> None:
        """Outside autocast, once per micro-batch; each loss is scaled by the same factor."""
        for loss in losses:
            (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        parameters: Iterable[torch.Tensor],
        clip_val: float | None,
        clip_algorithm: str = "norm",
        loss: torch.Tensor | None = None,
    ) -> StepResult:
        """unscale_ (once per optimizer) → grad norm → clip → step → update (once).

        A step with inf/NaN gradients (or loss) changes no weight, in any optimizer: one flag
        decides for all. Fused optimizers get the flag as a tensor and skip on the device, so the
        step never waits for the device; others need it on the host (one read per step, as
        GradScaler itself reads it)."""
        if self._masters:  # fp16 gradients → the fp32 masters, which the optimizers update
            for param, master in self._masters.items():
                master.grad = None if param.grad is None else param.grad.float()
                param.grad = None
            parameters = [self._masters.get(p, p) for p in parameters]
        params = [p for p in parameters if p.grad is not None]
        if self.scaler:
            for opt in optimizers:
                self.scaler.unscale_(opt)
        grads = [p.grad for p in params]
        grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if clip_val is not None:
            if clip_algorithm == "norm":
                torch.nn.utils.clip_grads_with_norm_(params, clip_val, grad_norm, foreach=True)
            else:
                torch.nn.utils.clip_grad_value_(params, clip_val, foreach=True)
        if isinstance(grad_norm, DTensor):  # FSDP shards: the norm over all of them
            grad_norm = grad_norm.full_tensor()
        finite = torch.isfinite(grad_norm)
        if loss is not None:
            finite &= torch.isfinite(loss)
        skipped = (~finite).float()
        if all(steps_on_device(opt) for opt in optimizers):
            for opt in optimizers:  # the protocol GradScaler uses with fused optimizers
                opt.grad_scale, opt.found_inf = None, skipped
                try:
                    opt.step()
                finally:
                    del opt.grad_scale, opt.found_inf
        elif finite.item():  # all optimizers step, or none: a GAN's two halves skip together
            for opt in optimizers:
                if self.scaler:
                    self.scaler.step(opt)
                else:
                    opt.step()
        with torch.no_grad():  # a skipped step left the masters as they were: copying is harmless
            for param, master in self._masters.items():
                param.copy_(master)
        if self.scaler:
            loss_scale = self.scaler._get_scale_async().clone()  # update() changes it in place
            self.scaler.update()  # backs the scale off if unscale_ found inf/NaN
        else:
            loss_scale = self._no_scale  # never written to: one tensor serves every step
        return StepResult(grad_norm.detach(), skipped, loss_scale)

    @property
    def loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler else 1.0

    def state_dict(self) -> dict:
        """The scaler's state, and fp16_master's fp32 weights (in the model's parameter order)."""
        return {
            "scaler": self.scaler.state_dict() if self.scaler else None,
            **({"master_weights": list(self._masters.values())} if self._masters else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        """After `at_step`: the stage in force decides whether a scaler state applies."""
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        saved = state.get("master_weights") or []
        if self._masters and len(saved) != len(self._masters):
            raise UserError("the checkpoint has no fp32 master weights for precision=fp16_master")
        with torch.no_grad():
            for (param, master), value in zip(self._masters.items(), saved, strict=False):
                master.copy_(value)
                param.copy_(value)

    def describe(self) -> str:
        if self.requested == "staged":
            parts = [
                f"{mode} until step {until}" if until is not None else f"then {mode}"
                for until, mode, _ in self.stages
            ]
            return f"staged: {', '.join(parts)}"
        text = self.mode if self.requested == self.mode else f"{self.requested} → {self.mode}"
        return f"{text} ({self.reason})"
