"""The optimizer and schedule keys the runner reads (`optim`), checked before the first job."""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig

from runner.config.rules import number, require
from runner.config.schema import ADAMW, ADAMW8BIT, OWN_ADAMW_KEYS, SCHEDULE_DECAYS
from runner.errors import UserError


def validate_state(o, dtype, update: str) -> None:
    """`optim.state_dtype` and bf16_true's update rules are the runner's AdamW's (torch's keeps
    moments in the weights' dtype and rounds to nearest); adamw8bit rounds stochastically."""
    target, own = o.get("_target_"), dtype is not None or update != "plain"
    require(dtype in (None, "fp32", "bf16"), "optim.state_dtype", dtype, "fp32, bf16 or null")
    why = f"applies to optim=adamw, not {target} (it keeps its own state)"
    require(dtype is None or target == ADAMW, "optim.state_dtype", dtype, why)
    sr8 = update == "stochastic_rounding" and target == ADAMW8BIT
    why = f"needs optim=adamw (or adamw8bit for stochastic_rounding), not {target}"
    require(update == "plain" or sr8 or target == ADAMW, "precision.update", update, why)
    extra = sorted(set(o) - OWN_ADAMW_KEYS) if own and not sr8 else []
    why = "the runner's AdamW (optim.state_dtype, precision.update) takes lr, betas, eps, wd only"
    require(not extra, "optim.optimizer", extra, why)


def validate_optim(optim, update: str = "plain") -> None:
    """The optimizer's keys where present (AdamW has betas, SGD has momentum), and the schedule
    the runner reads. Here rather than at build time so that a sweep fails before its first job."""
    for group in ("optimizer", "scheduler"):
        node = optim.get(group)
        require(
            isinstance(node, DictConfig),
            f"optim.{group}",
            node,
            "must be a group of keys, as in conf/optim/adamw.yaml",
        )
    o, s = optim.optimizer, optim.scheduler
    validate_state(o, optim.get("state_dtype"), update)
    if "fused" in o:
        require(
            o.fused is None or isinstance(o.fused, bool),
            "optim.optimizer.fused",
            o.fused,
            "must be true, false or null",
        )
    if "lr" in o:
        require(number(o.lr) and o.lr > 0, "optim.optimizer.lr", o.lr, "must be a number > 0")
    if "eps" in o:
        require(number(o.eps) and o.eps > 0, "optim.optimizer.eps", o.eps, "must be a number > 0")
    if "weight_decay" in o:
        wd = o.weight_decay
        require(number(wd) and wd >= 0, "optim.optimizer.weight_decay", wd, "must be a number ≥ 0")
    if "momentum" in o:
        m = o.momentum
        require(
            number(m) and 0 <= m < 1, "optim.optimizer.momentum", m, "must be a number in [0, 1)"
        )
    if "betas" in o:
        b = o.betas
        require(
            isinstance(b, ListConfig) and len(b) == 2 and all(number(x) and 0 <= x < 1 for x in b),
            "optim.optimizer.betas",
            b,
            "must be a list of two numbers in [0, 1), e.g. [0.9, 0.999]",
        )
    for key in ("decay", "warmup_steps", "min_lr_ratio"):
        if key not in s:
            raise UserError(f"optim.scheduler.{key} is required: the runner's schedule reads it")
    require(
        s.decay in SCHEDULE_DECAYS,
        "optim.scheduler.decay",
        s.decay,
        "allowed: " + ", ".join(SCHEDULE_DECAYS),
    )
    w = s.warmup_steps
    require(
        isinstance(w, int) and not isinstance(w, bool) and w >= 0,
        "optim.scheduler.warmup_steps",
        w,
        "must be an integer ≥ 0",
    )
    r = s.min_lr_ratio
    require(
        number(r) and 0 <= r <= 1, "optim.scheduler.min_lr_ratio", r, "must be a number in [0, 1]"
    )
