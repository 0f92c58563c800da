"""The checks of a composed config that Hydra's types cannot express: ranges and choices of the
runner-owned groups; the optimizer's keys are checked in optim.py, the task groups' in tasks.py.
Each failure is one UserError line naming the key, its value and what is allowed."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from runner.config.optim import validate_optim
from runner.config.rules import integer, number, require
from runner.config.schema import (
    ADAPTER_DTYPES,
    BF16_UPDATES,
    CPU_KERNELS,
    EVAL_PRECISIONS,
    GPU_MEMORY_GB,
    Config,
    StageConfig,
)
from runner.config.tasks import validate_task
from runner.precision.modes import MODES, choices


def _validate_stages(stages) -> None:
    require(len(stages) > 0, "precision.stages", [], "precision=staged needs at least one stage")
    previous = 0
    for i, stage in enumerate(stages):
        key = f"precision.stages.{i}"
        require(
            stage.mode in choices(stage=True),
            f"{key}.mode",
            stage.mode,
            "allowed: " + ", ".join(choices(stage=True)),
        )
        if i == len(stages) - 1:
            require(
                stage.until_step is None,
                f"{key}.until_step",
                stage.until_step,
                "the last stage runs to the end: leave it null",
            )
        else:
            require(
                stage.until_step is not None and stage.until_step > previous,
                f"{key}.until_step",
                stage.until_step,
                f"must be a step after the previous stage's ({previous})",
            )
            previous = stage.until_step


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


def _validate_fp8(p) -> None:
    """precision.fp8 under an fp8 format (fp8, mxfp8): the keys the format ignores are refused
    (mxfp8's: fp8's recipe and all-gather); a staged run converts its Linears once, so to one
    format."""
    modes = {s.mode for s in p.stages} if p.mode == "staged" else {p.mode}
    formats = [MODES[m] for m in MODES if m in modes and MODES[m].fp8]
    names = " stages or ".join(m.name for m in formats)
    why = f"a run converts its Linears once: {names} stages, not both"
    require(len(formats) <= 1, "precision.stages", [s.mode for s in p.stages], why)
    for key, unset, why in formats[0].ignored_fp8_keys if formats else ():
        require(p.fp8[key] == unset, f"precision.fp8.{key}", p.fp8[key], why)


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
    for key in ("val_check_interval", "limit_val_batches", "checkpoint_every_n_steps"):
        require(t[key] >= 0, f"trainer.{key}", t[key], "must be ≥ 0")
    require(
        re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", t.device) is not None,
        "trainer.device",
        t.device,
        "allowed: auto, cpu, cuda, cuda:N, mps",
    )
    require(t.strategy in ("ddp", "fsdp"), "trainer.strategy", t.strategy, "allowed: ddp, fsdp")
    _validate_resume(t.resume)


def _validate_precision(p, t) -> None:
    """The mode (and its refusal under FSDP), a staged schedule, fp8's keys, the bf16 update
    rule, CPU kernels, adapter and reduce dtypes, fp8's kept blocks."""
    refusal = MODES[p.mode].fsdp_refusal if p.mode in MODES else None
    require(not (t.strategy == "fsdp" and refusal), "precision.mode", p.mode, refusal or "")
    require(
        p.mode in choices(),
        "precision.mode",
        p.mode,
        "allowed: " + ", ".join(choices()),
    )
    if p.mode == "staged":
        _validate_stages(p.stages)
    _validate_fp8(p)
    update = p["update"]
    require(update in BF16_UPDATES, "precision.update", update, ", ".join(BF16_UPDATES))
    why = "applies to a mode that holds bf16 weights (precision=bf16_true) only"
    bf16_weights = p.mode in MODES and MODES[p.mode].weights == "bf16"
    require(update == "plain" or bf16_weights, "precision.update", update, why)
    require(
        p.cpu_kernels in CPU_KERNELS,
        "precision.cpu_kernels",
        p.cpu_kernels,
        "allowed: " + ", ".join(CPU_KERNELS),
    )
    require(
        p.adapter_dtype in ADAPTER_DTYPES,
        "precision.adapter_dtype",
        p.adapter_dtype,
        "allowed: " + ", ".join(ADAPTER_DTYPES),
    )
    require(
        p.reduce_dtype in ("fp32", "bf16"),
        "precision.reduce_dtype",
        p.reduce_dtype,
        "allowed: fp32, bf16",
    )
    for end in ("first", "last"):
        kept = p.fp8.keep_bf16[end]
        key = f"precision.fp8.keep_bf16.{end}"
        require(kept >= 0, key, kept, "a number of the model's blocks: must be ≥ 0")


def _validate_grad_scaler(gs) -> None:
    require(
        number(gs.init_scale) and gs.init_scale > 0,
        "precision.grad_scaler.init_scale",
        gs.init_scale,
        "must be a finite number > 0",
    )
    require(
        number(gs.growth_factor) and gs.growth_factor > 1,
        "precision.grad_scaler.growth_factor",
        gs.growth_factor,
        "must be a finite number > 1",
    )
    require(
        0 < gs.backoff_factor < 1,
        "precision.grad_scaler.backoff_factor",
        gs.backoff_factor,
        "must be between 0 and 1",
    )
    require(
        gs.growth_interval >= 1,
        "precision.grad_scaler.growth_interval",
        gs.growth_interval,
        "must be ≥ 1",
    )
    require(gs.hysteresis >= 1, "precision.grad_scaler.hysteresis", gs.hysteresis, "must be ≥ 1")
    # The floor and the cap hold init_scale between them, so the first step is inside already.
    floor, cap, init = gs.min_scale, gs.max_scale, gs.init_scale
    require(
        floor is None or (number(floor) and 0 < floor <= init),
        "precision.grad_scaler.min_scale",
        floor,
        f"must be null or a finite number > 0 and ≤ init_scale ({init:g})",
    )
    require(
        cap is None or (number(cap) and cap >= init),
        "precision.grad_scaler.max_scale",
        cap,
        f"must be null or a finite number ≥ init_scale ({init:g})",
    )


def _validate_logger(lg) -> None:
    require(lg.backend in ("wandb", "none"), "logger.backend", lg.backend, "allowed: wandb, none")
    require(
        lg.mode in ("offline", "online", "disabled"),
        "logger.mode",
        lg.mode,
        "allowed: offline, online, disabled",
    )


def _validate_modules(p) -> None:
    """precision.fp32_modules and precision.norm_modules: names or fnmatch patterns."""
    islands = p.fp32_modules
    require(
        islands == "auto" or isinstance(islands, ListConfig),
        "precision.fp32_modules",
        islands,
        "a list of module names or fnmatch patterns ([name, ...]), or auto (searched first)",
    )
    for pattern in [] if islands == "auto" else islands:
        require(
            isinstance(pattern, str) and pattern.strip() != "",
            "precision.fp32_modules",
            list(islands),
            "module names or fnmatch patterns, none empty (an empty name is the whole model)",
        )
    for pattern in p.norm_modules:
        require(
            pattern.strip() != "",
            "precision.norm_modules",
            list(p.norm_modules),
            "class names or fnmatch patterns of module names, none empty",
        )


def _validate_runner(cfg: DictConfig) -> None:
    p = cfg.precision
    r = cfg.runner
    for key, least in (
        ("seeds", 1),
        ("speed_rounds", 2),
        ("speed_steps", 1),
        ("islands_max", 1),
        ("islands_steps", 1),
    ):
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
    require(
        not (r.max_batch and p.mode == "staged"),
        "runner.max_batch",
        r.max_batch,
        "precision=staged changes its memory by stage: search each stage's mode on its own",
    )


def _validate_compare(c) -> None:
    """The comparison's target (runner/compare/target.py); a config saved before it has none."""
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
