"""The precision in force: which mode runs (a fixed one, `auto`, or a `staged` schedule by
optimizer step), its autocast context, its loss scaler (runner/precision/scaler.py), and the
process-wide TF32 settings."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from runner.errors import UserError
from runner.precision import autopilot, fp32_islands, recipe
from runner.precision.caps import DeviceCaps
from runner.precision.cpu_kernels import LOW_DTYPES, FastKernels, emulated_dtypes
from runner.precision.master import MasterWeights
from runner.precision.modes import Mode, mode_of
from runner.precision.norms import norm_layers
from runner.precision.reduce import average_over_ranks
from runner.precision.scaler import LossScaler
from runner.precision.step import StepResult, optimizer_step


class Precision:
    """The precision in force on one device: resolves `auto`, checks support, owns the scaler,
    fp16_master's fp32 master weights and a converting mode's converted Linears, and follows a
    `staged` schedule step by step; what each mode is, it asks the mode (runner/precision/modes/).

    The loop calls `autocast()`, `backward()` and `step()`; it never touches `torch.amp`."""

    def __init__(
        self,
        cfg,
        device: torch.device,
        caps: DeviceCaps | None = None,
        sharded: bool = False,
        world: int = 1,
    ):
        """`sharded`: gradients are FSDP shards, so fp16 needs a scaler that agrees over ranks.
        `world`: the ranks whose gradients fp16_master averages itself (it is not DDP-wrapped)."""
        self.caps = caps or DeviceCaps.probe(device)
        self.sharded, self.world = sharded, world
        self.cfg, self.requested, self.device = cfg, cfg.mode, device
        self.warnings: list[str] = []
        staged = cfg.mode == "staged"
        plan = [(s.until_step, s.mode) for s in cfg.stages] if staged else [(None, cfg.mode)]
        # (until_step, mode, why) per stage; one stage unless staged
        self.stages = [(until, *self._resolve(mode)) for until, mode in plan]
        self.name = "staged" if staged else self.stages[0][1]
        modes = [m for _, m, _ in self.stages]
        self.loss_scaler = LossScaler(cfg.grad_scaler, device, sharded, modes)
        self.master = MasterWeights()
        # a converting mode's Linears are converted once; they compute so in its stages only
        converting = [mode_of(m) for m in modes if mode_of(m).converts]  # one format (validation)
        self.converted = converting[0].linears(cfg.fp8, self.caps) if converting else None
        if self.converted:  # precision.recipe's rules, ahead of the shorthands; its default last
            self.converted.follow(recipe.for_run(cfg, self.converted.compute, self.caps), device)
        self.autopilot = autopilot.for_run(cfg, self.name, self.converted, device)
        # precision.cpu_kernels: entered around `fit`, the dtypes whose matmuls compute in fp32
        self.fast_kernels = FastKernels(emulated_dtypes(cfg.cpu_kernels, self.caps, modes))
        self._saved_matmul_precision = torch.get_float32_matmul_precision()
        self._saved_cudnn_tf32 = torch.backends.cudnn.allow_tf32
        self.mode = ""
        self._enter(*self.stages[0][1:])

    def _resolve(self, mode: str) -> tuple[str, str]:
        """(mode, why): `auto` decided, and a mode the device lacks refused or warned about."""
        if mode == "auto":
            return self.caps.best_mode()
        native, why = self.caps.support(mode_of(mode).compute)
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

    @property
    def scaler(self) -> LossScaler | None:
        """The loss scaler in force: only in loss-scaled modes."""
        return self.loss_scaler.active

    def _enter(self, mode: str, reason: str) -> None:
        self.mode, self.reason = mode, reason
        self.in_force: Mode = mode_of(mode)
        self.dtype = self.in_force.autocast
        self.loss_scaler.enter(self.in_force)
        if self.converted:
            self.converted.active = self.in_force.converts
        self.in_force.set_matmuls()

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
        """The fp32 islands, and `fp32_head` (precision.fp32_head's output head), in every mode
        (a later stage may autocast); then each stage's mode does what it does to the model once."""
        self.fp32_head = fp32_islands.output_head(model) if self.cfg.fp32_head else None
        names = [*fp32_modules, self.fp32_head] if self.fp32_head else fp32_modules
        kept = fp32_islands.keep_fp32(model, names, self.device.type)
        norms = norm_layers(model, self.cfg.norm_modules)  # in every mode: a typo is an error
        for mode in dict.fromkeys(m for _, m, _ in self.stages):
            mode_of(mode).convert(self, model, kept, norms)

    def counting(self) -> contextlib.AbstractContextManager:
        """In the audited step: what the mode adds to the audit (its converted GEMMs' FLOPs)."""
        return self.converted.counting() if self.converted else contextlib.nullcontext()

    def optimizer_groups(self, groups: dict[str, list]) -> dict[str, list]:
        return self.master.optimizer_groups(groups)

    @property
    def cpu_kernels(self) -> str:
        """What ran the low-precision matmuls so far: "fast" once the fast kernels computed one
        in fp32, else "native" (PyTorch's kernels; fp32 and tf32 runs too)."""
        return "fast" if self.fast_kernels.calls else "native"

    def emulates(self, mode: str) -> bool:
        """Whether `mode`'s low-precision matmuls compute in fp32 here (cpu_kernels=fast)."""
        return LOW_DTYPES.get(mode_of(mode).compute) in self.fast_kernels.dtypes

    def kernel_notes(self) -> list[str]:
        """The opening lines on what the fast kernels do, one per emulated dtype."""
        return [
            f"{name} matmuls: emulated in fp32, same numerics, speed not {name}'s"
            for name, dtype in LOW_DTYPES.items()
            if dtype in self.fast_kernels.dtypes
        ]

    @property
    def peak_mode(self) -> Mode:
        """The mode whose peak rate (its `compute`'s) the device's MFU is measured against: fp32
        where the fast CPU kernels compute the mode's matmuls in fp32."""
        return mode_of("fp32") if self.emulates(self.mode) else self.in_force

    def memory(self, model: torch.nn.Module) -> dict:
        return self.master.memory(model)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Wraps forward and loss only. Inputs stay fp32; weights stay fp32 (no .half())."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, losses: Sequence[torch.Tensor]) -> None:
        """Outside autocast, once per micro-batch; each loss is scaled by the same factor. With
        several ranks, × ranks: their average (DDP's) is then the sum over the global window."""
        scaler = self.scaler
        for loss in losses:
            loss = loss * self.world if self.world > 1 else loss
            (scaler.scale(loss) if scaler else loss).backward()
        self.master.accumulate()

    def step(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        parameters: Sequence[torch.Tensor],
        clip_val: float | None,
        clip_algorithm: str = "norm",
        loss: torch.Tensor | None = None,
        clip_per_group: bool = True,
    ) -> StepResult:
        """unscale_ (once per optimizer) → grad norm → clip → step → update (once). `parameters`:
        the model's trainable ones, in its order (fp16_master's stand for their fp32 masters)."""
        result = optimizer_step(
            optimizers,
            self.master.stand_ins(parameters),
            self.scaler,
            clip_val,
            clip_algorithm,
            clip_per_group,
            loss,
            reduce=self._average_over_ranks if self.master and self.world > 1 else None,
            no_scale=self.loss_scaler.unscaled,
        )
        self.master.copy_back()
        if self.converted:
            self.converted.after_step()
        return result

    def _average_over_ranks(self, grads: list[torch.Tensor]) -> None:
        """fp16_master under several ranks: the fp32 gradients, averaged as DDP would, in
        `reduce_dtype` (bf16: sent and summed in bf16, then back to fp32)."""
        low = self.cfg.reduce_dtype == "bf16"
        average_over_ranks(grads, self.world, torch.bfloat16 if low else torch.float32)

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    def state_dict(self) -> dict:
        """The scaler's state (also while dormant between fp16 stages), and fp16_master's fp32
        weights (in the model's parameter order)."""
        return {"scaler": self.loss_scaler.state_dict(), **self.master.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.loss_scaler.load_state_dict(state.get("scaler"))
        self.master.load_state_dict(state)

    def describe(self) -> str:
        if self.requested == "staged":
            parts = [
                f"{mode} until step {until}" if until is not None else f"then {mode}"
                for until, mode, _ in self.stages
            ]
            return f"staged: {', '.join(parts)}"
        text = self.mode if self.requested == self.mode else f"{self.requested} → {self.mode}"
        return f"{text} ({self.reason})"
