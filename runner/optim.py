"""Optimizer and learning-rate schedule from the `optim` config group."""

from __future__ import annotations

import math

import torch
from hydra.utils import instantiate
from torch import nn

from runner.errors import building


def build_optimizer(cfg, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Weight decay on weight matrices only: biases and norm scales are left alone."""
    groups = [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    with building("optim.optimizer", cfg.optimizer):  # `_partial_`: the call raises, too
        return instantiate(cfg.optimizer)([g for g in groups if g["params"]])


def lr_factor(
    step: int, max_steps: int, warmup_steps: int, decay: str, min_lr_ratio: float
) -> float:
    """Linear warm-up to the peak, then `decay` down to `min_lr_ratio` of it at `max_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if decay == "constant":
        return 1.0
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1 - progress
    return min_lr_ratio + (1 - min_lr_ratio) * shape


def build_scheduler(cfg, optimizer: torch.optim.Optimizer, max_steps: int):
    """Advanced only on optimizer steps that were applied (not on steps the scaler skipped).
    The keys are checked by `runner.config.validate`."""
    s = cfg.scheduler
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, max_steps, s.warmup_steps, s.decay, s.min_lr_ratio)
    )


def build_optimizers(
    cfg, groups: dict[str, list[nn.Parameter]], max_steps: int
) -> tuple[dict, dict]:
    """One optimizer and one schedule per parameter group (a GAN has two: see
    `Task.parameter_groups`, and `Precision.optimizer_groups` for fp16_master's fp32 copies)."""
    optimizers = {name: build_optimizer(cfg, params) for name, params in groups.items()}
    schedulers = {name: build_scheduler(cfg, opt, max_steps) for name, opt in optimizers.items()}
    return optimizers, schedulers
