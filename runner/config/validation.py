"""The checks of a composed config that Hydra's types cannot express: ranges and choices of the
runner-owned groups; the optimizer's keys are checked in optim.py, the task groups' in tasks.py.
Each failure is one UserError line naming the key, its value and what is allowed."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from runner.config.optim import validate_optim
from runner.config.precision_rules import (
    _validate_grad_scaler,
    _validate_modules,
    _validate_precision,
)
from runner.config.rules import choices, integer, number, require
from runner.config.schema import AUTO_SEEDS, EVAL_PRECISIONS, GPU_MEMORY_GB, Config, StageConfig
from runner.config.tasks import validate_task


def _validate_resume(spec: str | None) -> None:
    """trainer.resume: null, auto, or a checkpoint that is there (a file, or a sharded set's
    folder), so that a path that cannot be read fails before anything is built."""
    if spec in (None, "", "auto"):
        return
    why = ""
    try:
        there = Path(spec).expanduser().exists()
    except OSError as e:  # a name longer than the filesystem allows, ...
        there, why = False, f" ({e.strerror})"
    require(there, "trainer.resume", spec, f"no checkpoint there{why}: a path to one, or auto")


def _validate_known(node, schema, path: str) -> None:
    """Every key of a runner-owned group is one its schema has: `++trainer.max_stepz=5` adds a
    key that nothing would read."""
    if isinstance(node, DictConfig) and isinstance(schema, DictConfig):
        for key in node:
            require(
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
        require(key in known, key, cfg.get(key), f"not a key (allowed: {', '.join(known)})")
    for group in ("precision", "trainer", "logger", "runner"):
        _validate_known(cfg[group], schema[group], group)
    _validate_trainer(cfg.trainer)
    _validate_precision(cfg.precision, cfg.trainer)
    _validate_grad_scaler(cfg.precision.grad_scaler)
    _validate_logger(cfg.logger)
    _validate_modules(cfg.precision)
    require(
        integer(cfg.seed) and 0 <= cfg.seed < 2**32,
        "seed",
        cfg.seed,
        "must be an integer in [0, 2**32)",
    )
    cache = Path(str(cfg.cache_dir)).expanduser()
    require(not cache.exists() or cache.is_dir(), "cache_dir", cfg.cache_dir, "must be a folder")
    _validate_runner(cfg)
    _validate_compare(cfg.get("compare") or OmegaConf.structured(Config).compare)
    validate_optim(cfg.optim, cfg.precision["update"])
    validate_task(cfg)


def _validate_trainer(t) -> None:
    for key in (
        "max_steps",
        "accumulate_grad_batches",
        "log_every_n_steps",
        "keep_last_k",
        "max_consecutive_nonfinite",
    ):
        require(t[key] >= 1, f"trainer.{key}", t[key], "must be ≥ 1")
    require(
        t.gradient_clip_val is None or t.gradient_clip_val >= 0,
        "trainer.gradient_clip_val",
        t.gradient_clip_val,
        "must be ≥ 0, or null to turn clipping off",
    )
    require(
        t.gradient_clip_algorithm in ("norm", "value"),
        "trainer.gradient_clip_algorithm",
        t.gradient_clip_algorithm,
        "allowed: norm, value",
    )
    warmup = t.benchmark.warmup_steps
    require(warmup >= 0, "trainer.benchmark.warmup_steps", warmup, "must be ≥ 0")
    threads = t.cpu_threads
    require(threads is None or threads >= 1, "trainer.cpu_threads", threads, "null or ≥ 1")
    for key in ("val_check_interval", "limit_val_batches", "checkpoint_every_n_steps"):
        require(t[key] >= 0, f"trainer.{key}", t[key], "must be ≥ 0")
    require(
        re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", t.device) is not None,
        "trainer.device",
        t.device,
        "allowed: auto, cpu, cuda, cuda:N, mps",
    )
    require(t.strategy in ("ddp", "fsdp"), "trainer.strategy", t.strategy, "allowed: ddp, fsdp")
    limit = t.time_limit_s
    require(
        limit in (None, "auto")
        or (isinstance(limit, int | float) and not isinstance(limit, bool) and limit > 0),
        "trainer.time_limit_s",
        limit,
        "allowed: auto (SLURM's end time), seconds > 0, or null",
    )
    margin = t.time_limit_margin_s
    require(margin >= 0, "trainer.time_limit_margin_s", margin, "must be ≥ 0")
    _validate_resume(t.resume)


def _validate_logger(lg) -> None:
    require(lg.backend in ("wandb", "none"), "logger.backend", lg.backend, "allowed: wandb, none")
    require(
        lg.mode in ("offline", "online", "disabled"),
        "logger.mode",
        lg.mode,
        "allowed: offline, online, disabled",
    )


def _validate_runner(cfg: DictConfig) -> None:
    p = cfg.precision
    r = cfg.runner
    require(
        r.seeds == "auto" or (isinstance(r.seeds, int) and not isinstance(r.seeds, bool)),
        "runner.seeds",
        r.seeds,
        "a number of seeds, or auto",
    )
    for key, least in (
        ("seeds", 1),
        ("max_seeds", AUTO_SEEDS),
        ("speed_rounds", 2),
        ("speed_steps", 1),
        ("islands_max", 1),
        ("islands_steps", 1),
        ("recipe_max", 1),
        ("recipe_steps", 1),
        ("recipe_seeds", 1),
    ):
        if r[key] != "auto":
            require(r[key] >= least, f"runner.{key}", r[key], f"must be ≥ {least}")
    require(r.speed in ("jobs", "interleaved"), "runner.speed", r.speed, "jobs or interleaved")
    require(r.summary in ("short", "full"), "runner.summary", r.summary, "short or full")
    asked = list(r.eval_precisions)
    bad = [name for name in asked if name not in EVAL_PRECISIONS]
    require(not bad, "runner.eval_precisions", asked, "allowed: " + ", ".join(EVAL_PRECISIONS))
    require(
        not asked or cfg.trainer.limit_val_batches > 0,
        "runner.eval_precisions",
        asked,
        "they evaluate the validation batches: needs trainer.limit_val_batches > 0",
    )
    require(
        not asked or cfg.trainer.strategy != "fsdp",
        "runner.eval_precisions",
        asked,
        "they copy the whole weights on rank 0: not with trainer.strategy=fsdp (use ddp)",
    )
    budget = r.memory_budget_gb
    require(
        budget is None
        or (number(budget) and budget > 0)
        or (isinstance(budget, str) and budget.upper() in GPU_MEMORY_GB),
        "runner.memory_budget_gb",
        budget,
        "GB (a number > 0), a GPU's name (" + ", ".join(GPU_MEMORY_GB) + "), or null",
    )
    modes = choices("precision")
    bad = [name for name in r.project_precisions if name not in modes]
    require(not bad, "runner.project_precisions", list(r.project_precisions), ", ".join(modes))
    require(
        not (r.max_batch and p.mode == "staged"),
        "runner.max_batch",
        r.max_batch,
        "precision=staged changes its memory by stage: search each stage's mode on its own",
    )


def _validate_compare(c) -> None:
    """The comparison's target (runner/compare/target.py); a config saved before it has none."""
    tolerance = c.get("tolerance", 0.02)
    require(
        isinstance(tolerance, float | int) and 0 < tolerance < 1,
        "compare.tolerance",
        tolerance,
        "a share of the baseline's loss, between 0 and 1 (0.02: 2%)",
    )
    direction = c.target_direction
    require(
        direction in (None, "lower", "higher"),
        "compare.target_direction",
        direction,
        "lower, higher or null",
    )
    require(
        str(c.target_metric).startswith("eval_"),
        "compare.target_metric",
        c.target_metric,
        "an evaluation metric (eval_loss, eval_accuracy, ...): the curve is the evaluations'",
    )
