"""One optimizer step, in the order AMP needs: unscale → measure → clip → step → update.

A step with inf/NaN gradients (or loss) changes no weight, in any optimizer: one flag decides for
all. Fused optimizers get the flag as a tensor and skip on the device, so the step never waits for
the device; others need it on the host (one read per step, as GradScaler itself reads it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from runner.precision.scaler import LossScaler


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


def _by_optimizer(optimizers, parameters) -> list[list[torch.Tensor]]:
    """Each optimizer's parameters that have gradients, in the order of `parameters`."""
    if len(optimizers) == 1:  # the common case: no owner map to build on every step
        return [[p for p in parameters if p.grad is not None]]
    owner = {
        id(p): i for i, opt in enumerate(optimizers) for g in opt.param_groups for p in g["params"]
    }
    groups: list[list[torch.Tensor]] = [[] for _ in optimizers]
    for p in parameters:
        if p.grad is not None:
            groups[owner[id(p)]].append(p)
    return groups


def _full(norm: torch.Tensor) -> torch.Tensor:
    """FSDP shards: the norm over all of them."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def optimizer_step(
    optimizers: Sequence[torch.optim.Optimizer],
    parameters: Sequence[torch.Tensor],
    scaler: LossScaler | None,
    clip_val: float | None,
    clip_algorithm: str = "norm",
    clip_per_group: bool = True,
    loss: torch.Tensor | None = None,
    reduce: Callable[[list[torch.Tensor]], None] | None = None,
    no_scale: torch.Tensor | None = None,
) -> StepResult:
    """`parameters`: what the optimizers update, in the model's order: the order the norm is summed
    in, as `clip_grad_norm_(model.parameters())` does (fp16's rounding noise makes it show).
    `clip_per_group`: each optimizer's gradients are clipped by their own norm (a GAN's two
    halves), as PyTorch's multi-optimizer AMP recipe does; the logged norm is over all of them.
    `reduce`: averages the gradients over ranks first, where no DDP wrapper did."""
    groups = _by_optimizer(optimizers, parameters)
    if reduce is not None:
        reduce([p.grad for params in groups for p in params])
    if scaler:
        for opt in optimizers:
            scaler.unscale_(opt)
    if not clip_per_group:
        groups = [[p for params in groups for p in params]]
    norms = [torch.nn.utils.get_total_norm([p.grad for p in ps], foreach=True) for ps in groups]
    if clip_val is not None:
        for params, norm in zip(groups, norms, strict=True):
            if clip_algorithm == "norm":
                torch.nn.utils.clip_grads_with_norm_(params, clip_val, norm, foreach=True)
            else:
                torch.nn.utils.clip_grad_value_(params, clip_val, foreach=True)
    full = [_full(n) for n in norms]
    grad_norm = full[0] if len(full) == 1 else torch.linalg.vector_norm(torch.stack(full))
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
            if scaler:
                scaler.step(opt)
            else:
                opt.step()
    if scaler:
        loss_scale = scaler.update()  # the scale the step's gradients carried
    else:
        loss_scale = no_scale if no_scale is not None else torch.ones((), device=grad_norm.device)
    return StepResult(grad_norm.detach(), skipped, loss_scale)
