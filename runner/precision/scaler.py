"""The run's loss scaler: torch's GradScaler (FSDP's ShardedGradScaler where the gradients are
shards, so every rank agrees on an overflow), in force in the stages that scale the loss and
dormant between them, so a second fp16 stage resumes at the scale the first reached."""

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
        """After the step: backs the scale off if unscale_ found inf/NaN, or grows it. Returns
        the scale this step's gradients carried, on the device (update changes it in place)."""
        used = self.grad_scaler._get_scale_async().clone()
        self.grad_scaler.update()
        return used

    @property
    def loss_scale(self) -> float:
        """The scale in force (a host read); 1.0 where none is."""
        return self.grad_scaler.get_scale() if self.in_force else 1.0

    def state_dict(self) -> dict | None:
        """GradScaler's state (also while dormant); None where the run scales no loss."""
        return self.grad_scaler.state_dict() if self.grad_scaler else None

    def load_state_dict(self, state: dict | None) -> None:
        if self.grad_scaler and state:
            self.grad_scaler.load_state_dict(state)


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
