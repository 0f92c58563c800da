"""The checks of a composed config that Hydra's types cannot express: ranges, choices, and the
optimizer and schedule keys the runner reads. Each failure is one UserError line naming the key,
its value and what is allowed."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from runner.config import (
    ADAMW,
    ADAMW8BIT,
    BF16_UPDATES,
    CPU_KERNELS,
    OWN_ADAMW_KEYS,
    SCHEDULE_DECAYS,
    Config,
    StageConfig,
)
from runner.errors import UserError, clip
from runner.precision.modes import MODES, choices


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise UserError(f"{key}={clip(repr(value))} is invalid: {allowed}")


def _validate_stages(stages) -> None:
    _require(len(stages) > 0, "precision.stages", [], "precision=staged needs at least one stage")
    previous = 0
    for i, stage in enumerate(stages):
        key = f"precision.stages.{i}"
        _require(
            stage.mode in choices(stage=True),
            f"{key}.mode",
            stage.mode,
            "allowed: " + ", ".join(choices(stage=True)),
        )
        if i == len(stages) - 1:
            _require(
                stage.until_step is None,
                f"{key}.until_step",
                stage.until_step,
                "the last stage runs to the end: leave it null",
            )
        else:
            _require(
                stage.until_step is not None and stage.until_step > previous,
                f"{key}.until_step",
                stage.until_step,
                f"must be a step after the previous stage's ({previous})",
            )
            previous = stage.until_step


def _number(value: Any) -> bool:
    """A finite int or float: a typo arrives as a string (lr=abc), and a bool is an int."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _validate_state(o, dtype, update: str) -> None:
    """`optim.state_dtype` and bf16_true's update rules are the runner's AdamW's (torch's keeps
    moments in the weights' dtype and rounds to nearest); adamw8bit rounds stochastically."""
    target, own = o.get("_target_"), dtype is not None or update != "plain"
    _require(dtype in (None, "fp32", "bf16"), "optim.state_dtype", dtype, "fp32, bf16 or null")
    why = f"applies to optim=adamw, not {target} (it keeps its own state)"
    _require(dtype is None or target == ADAMW, "optim.state_dtype", dtype, why)
    sr8 = update == "stochastic_rounding" and target == ADAMW8BIT
    why = f"needs optim=adamw (or adamw8bit for stochastic_rounding), not {target}"
    _require(update == "plain" or sr8 or target == ADAMW, "precision.update", update, why)
    extra = sorted(set(o) - OWN_ADAMW_KEYS) if own and not sr8 else []
    why = "the runner's AdamW (optim.state_dtype, precision.update) takes lr, betas, eps, wd only"
    _require(not extra, "optim.optimizer", extra, why)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# The documented keys of the task-owned groups (conf/model, conf/dataset), wherever a group has
# one: (what is allowed, the check). A bad value then names its key, not the constructor's
# complaint ("high <= 0", "'<' not supported between instances of 'str' and 'int'").
_POSITIVE = ("an integer ≥ 1", lambda v: _integer(v) and v >= 1)
_FRACTION = ("a number in [0, 1)", lambda v: _number(v) and 0 <= v < 1)
_SMALL = ("a number > 0", lambda v: _number(v) and v > 0)
TASK_KEYS: dict[str, dict[str, tuple[str, Any]]] = {
    "model": {
        **dict.fromkeys(
            (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "intermediate_size",
                "max_position_embeddings",
                "num_layers",
                "n_embd",
                "n_layer",
                "n_head",
                "n_positions",
                "width",
                "depth",
                "latent_dim",
            ),
            _POSITIVE,
        ),
        "dropout": _FRACTION,
        "initializer_range": _SMALL,
        "layer_norm_eps": _SMALL,
        "blocks_per_stage": (
            "a list of integers ≥ 1",
            lambda v: isinstance(v, ListConfig) and len(v) > 0 and all(_POSITIVE[1](x) for x in v),
        ),
    },
    "dataset": {
        **dict.fromkeys(
            (
                "batch_size",
                "num_samples",
                "num_documents",
                "num_features",
                "num_classes",
                "vocab_size",
                "seq_len",
                "image_size",
                "channels",
                "shapes_per_image",
                "words_per_document",
                "vocab_words",
                "num_topics",
            ),
            _POSITIVE,
        ),
        "num_workers": ("an integer ≥ 0", lambda v: _integer(v) and v >= 0),
        "validation_fraction": _FRACTION,
        "mlm_probability": ("a number in (0, 1)", lambda v: _number(v) and 0 < v < 1),
    },
}
# Pairs of keys in one group where the first must be a multiple of the second (attention heads).
DIVISIBLE = (("hidden_size", "num_attention_heads"), ("n_embd", "n_head"))


def _validate_task(cfg: DictConfig) -> None:
    for group, checks in TASK_KEYS.items():
        node = cfg.get(group)
        if not isinstance(node, DictConfig):
            continue
        for key, (allowed, ok) in checks.items():
            if key in node:
                _require(ok(node[key]), f"{group}.{key}", node[key], f"must be {allowed}")
        for whole, part in DIVISIBLE:
            if whole in node and part in node:
                _require(
                    node[whole] % node[part] == 0,
                    f"{group}.{whole}",
                    node[whole],
                    f"must be a multiple of {group}.{part} ({node[part]})",
                )
    model, dataset = cfg.get("model"), cfg.get("dataset")
    if isinstance(model, DictConfig) and isinstance(dataset, DictConfig) and "seq_len" in dataset:
        for key in ("max_position_embeddings", "n_positions"):
            if key in model:
                _require(
                    dataset.seq_len <= model[key],
                    "dataset.seq_len",
                    dataset.seq_len,
                    f"must be ≤ model.{key} ({model[key]})",
                )


def _validate_optim(optim, update: str = "plain") -> None:
    """The optimizer's keys where present (AdamW has betas, SGD has momentum), and the schedule
    the runner reads. Here rather than at build time so that a sweep fails before its first job."""
    for group in ("optimizer", "scheduler"):
        node = optim.get(group)
        _require(
            isinstance(node, DictConfig),
            f"optim.{group}",
            node,
            "must be a group of keys, as in conf/optim/adamw.yaml",
        )
    o, s = optim.optimizer, optim.scheduler
    _validate_state(o, optim.get("state_dtype"), update)
    if "fused" in o:
        _require(
            o.fused is None or isinstance(o.fused, bool),
            "optim.optimizer.fused",
            o.fused,
            "must be true, false or null",
        )
    if "lr" in o:
        _require(_number(o.lr) and o.lr > 0, "optim.optimizer.lr", o.lr, "must be a number > 0")
    if "eps" in o:
        _require(_number(o.eps) and o.eps > 0, "optim.optimizer.eps", o.eps, "must be a number > 0")
    if "weight_decay" in o:
        wd = o.weight_decay
        _require(
            _number(wd) and wd >= 0, "optim.optimizer.weight_decay", wd, "must be a number ≥ 0"
        )
    if "momentum" in o:
        m = o.momentum
        _require(
            _number(m) and 0 <= m < 1, "optim.optimizer.momentum", m, "must be a number in [0, 1)"
        )
    if "betas" in o:
        b = o.betas
        _require(
            isinstance(b, ListConfig) and len(b) == 2 and all(_number(x) and 0 <= x < 1 for x in b),
            "optim.optimizer.betas",
            b,
            "must be a list of two numbers in [0, 1), e.g. [0.9, 0.999]",
        )
    for key in ("decay", "warmup_steps", "min_lr_ratio"):
        if key not in s:
            raise UserError(f"optim.scheduler.{key} is required: the runner's schedule reads it")
    _require(
        s.decay in SCHEDULE_DECAYS,
        "optim.scheduler.decay",
        s.decay,
        "allowed: " + ", ".join(SCHEDULE_DECAYS),
    )
    w = s.warmup_steps
    _require(
        isinstance(w, int) and not isinstance(w, bool) and w >= 0,
        "optim.scheduler.warmup_steps",
        w,
        "must be an integer ≥ 0",
    )
    r = s.min_lr_ratio
    _require(
        _number(r) and 0 <= r <= 1, "optim.scheduler.min_lr_ratio", r, "must be a number in [0, 1]"
    )


def _validate_known(node, schema, path: str) -> None:
    """Every key of a runner-owned group is one its schema has: `++trainer.max_stepz=5` adds a
    key that nothing would read."""
    if isinstance(node, DictConfig) and isinstance(schema, DictConfig):
        for key in node:
            _require(
                key in schema,
                f"{path}.{key}",
                node.get(key),
                f"{path} has no key {key!r} (allowed: {', '.join(schema)})",
            )
            _validate_known(node[key], schema[key], f"{path}.{key}")
    elif isinstance(node, ListConfig) and path == "precision.stages":
        for i, stage in enumerate(node):
            _validate_known(stage, OmegaConf.structured(StageConfig), f"{path}.{i}")


def validate(cfg: DictConfig) -> None:
    """Checks that need more than a type: ranges and choices. Raises UserError."""
    schema = OmegaConf.structured(Config)
    known = list(schema.keys())  # `in` on a DictConfig passes over keys that are ??? (model)
    for key in cfg:
        _require(key in known, key, cfg.get(key), f"not a key (allowed: {', '.join(known)})")
    for group in ("precision", "trainer", "logger", "runner"):
        _validate_known(cfg[group], schema[group], group)
    t, p = cfg.trainer, cfg.precision
    for key in (
        "max_steps",
        "accumulate_grad_batches",
        "log_every_n_steps",
        "keep_last_k",
        "max_consecutive_nonfinite",
    ):
        _require(t[key] >= 1, f"trainer.{key}", t[key], "must be ≥ 1")
    _require(
        t.gradient_clip_val is None or t.gradient_clip_val >= 0,
        "trainer.gradient_clip_val",
        t.gradient_clip_val,
        "must be ≥ 0, or null to turn clipping off",
    )
    _require(
        t.gradient_clip_algorithm in ("norm", "value"),
        "trainer.gradient_clip_algorithm",
        t.gradient_clip_algorithm,
        "allowed: norm, value",
    )
    warmup = t.benchmark.warmup_steps
    _require(warmup >= 0, "trainer.benchmark.warmup_steps", warmup, "must be ≥ 0")
    for key in ("val_check_interval", "limit_val_batches", "checkpoint_every_n_steps"):
        _require(t[key] >= 0, f"trainer.{key}", t[key], "must be ≥ 0")
    _require(
        re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", t.device) is not None,
        "trainer.device",
        t.device,
        "allowed: auto, cpu, cuda, cuda:N, mps",
    )
    _require(t.strategy in ("ddp", "fsdp"), "trainer.strategy", t.strategy, "allowed: ddp, fsdp")
    refusal = MODES[p.mode].fsdp_refusal if p.mode in MODES else None
    _require(not (t.strategy == "fsdp" and refusal), "precision.mode", p.mode, refusal or "")
    _require(
        p.mode in choices(),
        "precision.mode",
        p.mode,
        "allowed: " + ", ".join(choices()),
    )
    if p.mode == "staged":
        _validate_stages(p.stages)
    update = p["update"]
    _require(update in BF16_UPDATES, "precision.update", update, ", ".join(BF16_UPDATES))
    why = "applies to precision=bf16_true only"
    _require(update == "plain" or p.mode == "bf16_true", "precision.update", update, why)
    _require(
        p.cpu_kernels in CPU_KERNELS,
        "precision.cpu_kernels",
        p.cpu_kernels,
        "allowed: " + ", ".join(CPU_KERNELS),
    )
    _require(
        p.reduce_dtype in ("fp32", "bf16"),
        "precision.reduce_dtype",
        p.reduce_dtype,
        "allowed: fp32, bf16",
    )
    gs = p.grad_scaler
    _require(
        _number(gs.init_scale) and gs.init_scale > 0,
        "precision.grad_scaler.init_scale",
        gs.init_scale,
        "must be a finite number > 0",
    )
    _require(
        _number(gs.growth_factor) and gs.growth_factor > 1,
        "precision.grad_scaler.growth_factor",
        gs.growth_factor,
        "must be a finite number > 1",
    )
    _require(
        0 < gs.backoff_factor < 1,
        "precision.grad_scaler.backoff_factor",
        gs.backoff_factor,
        "must be between 0 and 1",
    )
    _require(
        gs.growth_interval >= 1,
        "precision.grad_scaler.growth_interval",
        gs.growth_interval,
        "must be ≥ 1",
    )
    lg = cfg.logger
    _require(lg.backend in ("wandb", "none"), "logger.backend", lg.backend, "allowed: wandb, none")
    _require(
        lg.mode in ("offline", "online", "disabled"),
        "logger.mode",
        lg.mode,
        "allowed: offline, online, disabled",
    )
    for pattern in p.fp32_modules:
        _require(
            isinstance(pattern, str) and pattern.strip() != "",
            "precision.fp32_modules",
            list(p.fp32_modules),
            "module names or fnmatch patterns, none empty (an empty name is the whole model)",
        )
    for pattern in p.norm_modules:
        _require(
            pattern.strip() != "",
            "precision.norm_modules",
            list(p.norm_modules),
            "class names or fnmatch patterns of module names, none empty",
        )
    _require(
        _integer(cfg.seed) and 0 <= cfg.seed < 2**32,
        "seed",
        cfg.seed,
        "must be an integer in [0, 2**32)",
    )
    cache = Path(str(cfg.cache_dir)).expanduser()
    _require(not cache.exists() or cache.is_dir(), "cache_dir", cfg.cache_dir, "must be a folder")
    r = cfg.runner
    for key, least in (("seeds", 1), ("speed_rounds", 2), ("speed_steps", 1)):
        _require(r[key] >= least, f"runner.{key}", r[key], f"must be ≥ {least}")
    _require(r.speed in ("jobs", "interleaved"), "runner.speed", r.speed, "jobs or interleaved")
    _validate_optim(cfg.optim, update)
    _validate_task(cfg)
