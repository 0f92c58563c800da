"""One accumulation window's forward and backward: each micro-batch under the precision's autocast,
its losses divided by the window's target count over all ranks, DDP's gradient averaging on the
last micro-batch only; and fp16 health's probe of the window's first micro-batch."""

from __future__ import annotations

import contextlib

import torch

from runner.measure.health import gradient_health
from runner.precision import Precision
from runner.task import Batch, Task
from runner.train import distributed
from runner.train.distributed import Dist
from runner.train.telemetry import Meter


def forward_backward(
    model: torch.nn.Module,
    window: list[Batch],
    norm,
    precision: Precision,
    meter: Meter,
    dist: Dist,
    to_device,
) -> dict[str, torch.Tensor]:
    """The window's summed losses over all ranks (on the device): `loss`, and `loss_<group>` for
    each loss of a multi-optimizer task."""
    totals: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(window):
        batch = to_device(batch)
        # DDP averages gradients over ranks once per window: on its last micro-batch.
        syncs = not dist.enabled or i == len(window) - 1
        with contextlib.nullcontext() if syncs else distributed.no_grad_sync(model):
            with precision.autocast(), meter.saving():
                losses = model(batch)
                if isinstance(losses, torch.Tensor):
                    losses = {"loss": losses}
                losses = {k: v / norm for k, v in losses.items()}
            precision.backward(list(losses.values()))
        for key, loss in losses.items():
            totals[key] = totals.get(key, 0) + loss.detach().float()
    totals = distributed.sum_values(totals, dist)  # the global window's: every rank's
    if "loss" not in totals:
        totals = {f"loss_{k}": v for k, v in totals.items()}
        totals["loss"] = sum(totals.values())
    return totals


def window_health(
    task: Task, window: list[Batch], precision: Precision, dist: Dist, to_device
) -> dict | None:
    """A loss-scaled mode's gradient health, on the window's first micro-batch. Not where the
    weights are cast (fp16_master's are fp16: no fp32 reference) nor under FSDP (sharded
    weights)."""
    mode = precision.in_force
    if not mode.scales_loss or mode.weights != "fp32" or precision.sharded:
        return None
    norm = sum(task.num_targets(b) for b in window) * dist.world
    return gradient_health(task, to_device(window[0]), norm, precision.loss_scale)
