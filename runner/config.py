"""Schemas of the runner-owned config groups and the checks Hydra's types cannot express.

The schemas live in Hydra's ConfigStore as `base_config`, so a misspelt key or a value of the
wrong type fails at compose time with the key's name. Task-owned groups (model, dataset, optim)
are free-form YAML with `_target_`: `validate` checks the optimizer and schedule keys the runner
knows, and `runner.errors.building` turns the rest into one line when their constructor fails.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig

from runner.errors import UserError

STAGE_MODES = ("fp32", "tf32", "fp16", "bf16", "fp8", "auto")  # the modes `staged` can use
PRECISION_MODES = (*STAGE_MODES, "staged", "fp16_master", "bf16_true")
LOSS_SCALED_MODES = ("fp16", "fp16_master")  # the modes that need a GradScaler
# bf16_true: how an update goes into a bf16 weight (runner/precision/bf16_true.py)
BF16_UPDATES = ("plain", "stochastic_rounding", "kahan")
ADAMW = "torch.optim.AdamW"  # optim=adamw; with optim.state_dtype or a bf16 update: runner's own
ADAMW8BIT = "torchao.optim.AdamW8bit"  # optim=adamw8bit
OWN_ADAMW_KEYS = {"_target_", "_partial_", "lr", "betas", "eps", "weight_decay", "fused", "foreach"}
SCHEDULE_DECAYS = ("cosine", "linear", "constant")


@dataclass
class GradScalerConfig:
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


@dataclass
class StageConfig:
    mode: str = "fp32"
    until_step: int | None = None  # runs the optimizer steps before this one; null: to the end


@dataclass
class Fp8Config:
    recipe: str = "tensorwise"  # torchao's: tensorwise, rowwise, rowwise_with_gw_hp
    # Left in bf16: "first"/"last" (the first and last Linear) and fnmatch patterns on names.
    skip: list[str] = field(default_factory=lambda: ["first", "last"])
    min_features: int = 0  # a Linear with a dimension below this stays bf16
    all_gather: bool = False  # FSDP2: gather converted weights in fp8


@dataclass
class PrecisionConfig:
    mode: str = "fp32"
    # mode=staged: the modes in force, in order, by optimizer step (conf/precision/staged.yaml).
    stages: list[StageConfig] = field(default_factory=list)
    grad_scaler: GradScalerConfig = field(default_factory=GradScalerConfig)
    # Run bf16/fp16/tf32 even where the device only emulates it (slow; the numbers mislead).
    allow_emulated: bool = False
    # Submodules (names as in model.named_modules(), e.g. model.cls) run with autocast off and
    # their inputs cast to fp32: for sensitive layers and ops that only support fp32.
    fp32_modules: list[str] = field(default_factory=list)
    # The dtype gradients are averaged over ranks in (DDP and FSDP): fp32, or bf16 (half the
    # traffic, rounded sums).
    reduce_dtype: str = "fp32"
    # precision=bf16_true (conf/precision/bf16_true.yaml): norm layers keep fp32 weights, and how
    # each update goes into a bf16 weight: plain (rounded to nearest: updates below half of
    # bf16's spacing are lost), stochastic_rounding, or kahan (a bf16 compensation buffer).
    keep_norms_fp32: bool = True
    update: str = "plain"  # read it as cfg["update"]: cfg.update is the mapping's method
    fp8: Fp8Config = field(default_factory=Fp8Config)  # precision=fp8 (conf/precision/fp8.yaml)


@dataclass
class BenchmarkConfig:
    # Steps left out of the speed figures (allocator, kernel selection, caches warming up).
    warmup_steps: int = 10


@dataclass
class TrainerConfig:
    max_steps: int = 300
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = 1.0
    gradient_clip_algorithm: str = "norm"
    # Several optimizers (a GAN): clip each one's gradients by their own norm, not all together.
    gradient_clip_per_group: bool = True
    log_every_n_steps: int = 10
    val_check_interval: int = 100
    limit_val_batches: int = 10
    checkpoint_every_n_steps: int = 0
    keep_last_k: int = 3  # step-N.pt files kept (last.pt always)
    resume: str | None = None  # null | auto | path/to/checkpoint.pt
    max_consecutive_nonfinite: int = 25  # skipped/non-finite steps in a row before the run stops
    device: str = "auto"
    # With several ranks (torchrun): ddp (replicated weights) or fsdp (FSDP2, sharded weights).
    strategy: str = "ddp"
    compile: bool = False  # torch.compile the task's forward and loss (the backward follows)
    progress_bar: bool = True
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)


@dataclass
class LoggerConfig:
    backend: str = "wandb"  # wandb | none (metrics.jsonl and summary.json are written either way)
    project: str = "amp-runner"
    entity: str | None = None
    mode: str = "offline"  # offline | online | disabled; WANDB_MODE in the environment wins
    group: str | None = None  # null: the sweep's name in a multirun, none for a single run
    name: str | None = None  # null: the model and the overrides that differ, e.g. bert-bf16
    job_type: str = "train"
    tags: list[str] = field(default_factory=list)
    init_timeout_s: float = 30.0


@dataclass
class RunnerConfig:
    seeds: int = 1  # a multirun runs each job with seeds seed..seed+N-1: loss gaps vs seed noise
    speed: str = "jobs"  # or interleaved: each group's precisions timed again (interleave.py)
    speed_rounds: int = 3  # interleaved: rounds alternating the order (median, IQR over them)
    speed_steps: int = 5  # interleaved: timed steps per precision and round, after 2 untimed


@dataclass
class Config:
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    model: Any = MISSING
    dataset: Any = MISSING
    optim: Any = MISSING
    seed: int = 0
    cache_dir: str = "~/.cache/amp-runner"


def register() -> None:
    ConfigStore.instance().store(name="base_config", node=Config)


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise UserError(f"{key}={value!r} is invalid: {allowed}")


def _validate_stages(stages) -> None:
    _require(len(stages) > 0, "precision.stages", [], "precision=staged needs at least one stage")
    previous = 0
    for i, stage in enumerate(stages):
        key = f"precision.stages.{i}"
        _require(
            stage.mode in STAGE_MODES,
            f"{key}.mode",
            stage.mode,
            "allowed: " + ", ".join(STAGE_MODES),
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


def validate(cfg: DictConfig) -> None:
    """Checks that need more than a type: ranges and choices. Raises UserError."""
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
    _require(
        not (t.strategy == "fsdp" and p.mode == "fp16_master"),
        "precision.mode",
        p.mode,
        "with trainer.strategy=fsdp use precision=fp16: FSDP's fp32 shards are the master weights",
    )
    _require(
        not (t.strategy == "fsdp" and p.mode == "bf16_true"),
        "precision.mode",
        p.mode,
        "with trainer.strategy=fsdp use precision=bf16: FSDP2 gathers one dtype per unit (not bf16 "
        "weights beside fp32 norms), and its fp32 shards already split the weight memory",
    )
    _require(
        p.mode in PRECISION_MODES,
        "precision.mode",
        p.mode,
        "allowed: " + ", ".join(PRECISION_MODES),
    )
    if p.mode == "staged":
        _validate_stages(p.stages)
    update = p["update"]
    _require(update in BF16_UPDATES, "precision.update", update, ", ".join(BF16_UPDATES))
    why = "applies to precision=bf16_true only"
    _require(update == "plain" or p.mode == "bf16_true", "precision.update", update, why)
    _require(
        p.reduce_dtype in ("fp32", "bf16"),
        "precision.reduce_dtype",
        p.reduce_dtype,
        "allowed: fp32, bf16",
    )
    gs = p.grad_scaler
    _require(gs.init_scale > 0, "precision.grad_scaler.init_scale", gs.init_scale, "must be > 0")
    _require(
        gs.growth_factor > 1, "precision.grad_scaler.growth_factor", gs.growth_factor, "must be > 1"
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
    r = cfg.runner
    for key, least in (("seeds", 1), ("speed_rounds", 2), ("speed_steps", 1)):
        _require(r[key] >= least, f"runner.{key}", r[key], f"must be ≥ {least}")
    _require(r.speed in ("jobs", "interleaved"), "runner.speed", r.speed, "jobs or interleaved")
    _validate_optim(cfg.optim, update)
