"""The run's loss scaler: torch's GradScaler (FSDP's ShardedGradScaler where the gradients are
shards, so every rank agrees on an overflow), in force in the stages that scale the loss and
dormant between them, so a second fp16 stage resumes at the scale the first reached.

Beyond GradScaler, as DeepSpeed and Megatron have them: `hysteresis` (overflows before the scale
backs off; Megatron's rule: the count starts again once the scale grows), `min_scale` (a floor:
an overflow at the floor collapses the scale, and the trainer stops the run) and `max_scale` (a
cap). All of it runs in tensor ops on the scale's device, so a step waits for no host read."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from runner.precision.modes import Mode, mode_of


class LossScaler:
    """One GradScaler for the run, made when any of its `modes` scales the loss; `active` is it
    while such a mode is in force. The step calls `scale`, `unscale_`, `step` and `update`."""

    def __init__(self, cfg, device: torch.device, sharded: bool, modes: Iterable[str]):
        """`cfg`: precision.grad_scaler. `sharded`: the gradients are FSDP shards."""
        self.cfg = cfg
        self.grad_scaler = (
            _make(cfg, device, sharded) if any(mode_of(m).scales_loss for m in modes) else None
        )
        self.in_force = False
        self.unscaled = torch.ones((), device=device)  # a step's loss scale where none is
        # With GradScaler's defaults its own update is the whole rule: not one op more.
        self._plain = cfg.hysteresis == 1 and cfg.min_scale is None and cfg.max_scale is None
        # Overflows still tolerated before one backs the scale off, and whether the scale has
        # collapsed (an overflow at the floor): device tensors, read on the host only when asked.
        self._tolerated = torch.full((), cfg.hysteresis - 1, dtype=torch.int32, device=device)
        self._collapsed = torch.zeros((), dtype=torch.bool, device=device)

    def enter(self, mode: Mode) -> None:
        """The stage's mode: in force if it scales the loss, else dormant (still checkpointed)."""
        self.in_force = self.grad_scaler is not None and mode.scales_loss

    @property
    def active(self) -> LossScaler | None:
        """Itself while a loss-scaled mode is in force; None otherwise."""
        return self if self.in_force else None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.grad_scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.grad_scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.grad_scaler.step(optimizer)

    def update(self) -> torch.Tensor:
        """After the step: backs the scale off if unscale_ found inf/NaN (past the hysteresis,
        down to the floor), or grows it (up to the cap). Returns the scale this step's gradients
        carried, on the device (update changes it in place)."""
        scale = self.grad_scaler._get_scale_async()
        used = scale.clone()
        self.grad_scaler.update()
        if not self._plain:
            self._limit(scale, used)
        return used

    def _limit(self, scale: torch.Tensor, used: torch.Tensor) -> None:
        """Hysteresis, floor and cap applied to what GradScaler's update did to `scale`. Its
        growth factor is > 1 and its backoff < 1 (validated), so the scale's move says what it
        saw: down, an overflow; up, growth_interval clean steps."""
        overflow, grew = scale < used, scale > used
        tolerated = overflow & (self._tolerated > 0)
        full = self.cfg.hysteresis - 1
        self._tolerated.copy_(torch.where(grew, full, self._tolerated - tolerated.int()))
        floor, cap = self.cfg.min_scale, self.cfg.max_scale
        limited = torch.where(tolerated, used, scale)  # a tolerated overflow keeps its scale
        if floor is not None:
            self._collapsed |= overflow & ~tolerated & (used <= floor)
        if floor is not None or cap is not None:
            limited = limited.clamp(floor, cap)
        scale.copy_(limited)

    def collapsed(self) -> bool:
        """Whether an overflow came at the floor (precision.grad_scaler.min_scale). A host read:
        the trainer asks on skipped steps only, whose flag it has read anyway."""
        return self.grad_scaler is not None and bool(self._collapsed)

    @property
    def loss_scale(self) -> float:
        """The scale in force (a host read); 1.0 where none is."""
        return self.grad_scaler.get_scale() if self.in_force else 1.0

    def state_dict(self) -> dict | None:
        """GradScaler's state and the overflows still tolerated (also while dormant); None
        where the run scales no loss."""
        if self.grad_scaler is None:
            return None
        return self.grad_scaler.state_dict() | {"tolerated": int(self._tolerated)}

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's scale, growth count and tolerated overflows, under this run's settings
        (precision.grad_scaler, which may differ from the run that wrote it: a resume is how
        fp16 health's advice is taken): its growth factor, backoff factor and interval, and the
        scale within its floor and cap, the count within its interval and hysteresis."""
        if not (self.grad_scaler and state):
            return
        cfg = self.cfg
        scale = min(max(state["scale"], cfg.min_scale or 0.0), cfg.max_scale or float("inf"))
        settings = {
            "growth_factor": cfg.growth_factor,
            "backoff_factor": cfg.backoff_factor,
            "growth_interval": cfg.growth_interval,
            # GradScaler grows when the count reaches the interval, not past it: a count at a
            # shorter interval's end grows on the next clean step
            "_growth_tracker": min(state["_growth_tracker"], cfg.growth_interval - 1),
        }
        self.grad_scaler.load_state_dict(state | settings | {"scale": scale})
        full = cfg.hysteresis - 1
        self._tolerated.fill_(min(state.get("tolerated", full), full))


def _make(cfg, device: torch.device, sharded: bool) -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as scaler
    return scaler(
        device.type,
        init_scale=cfg.init_scale,
        growth_factor=cfg.growth_factor,
        backoff_factor=cfg.backoff_factor,
        growth_interval=cfg.growth_interval,
    )
