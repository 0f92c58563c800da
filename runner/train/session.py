"""A trainer built for measuring, as `runner.run.run` builds one but without its bookkeeping (no
run folder, W&B, evaluation or checkpoints): the comparison's interleaved timing, the max-batch
search and scripts/bench.py fit short stretches through it."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from runner import console
from runner.build import build, seed_everything
from runner.measure.memory import reset_peak_memory, trainer_memory
from runner.precision import Precision
from runner.precision.caps import resolve_device
from runner.task import DataModule, Task
from runner.tracking import RunLog
from runner.train.optim import build_optimizers
from runner.train.trainer import Trainer

Timer = Callable[[], dict]  # one timing: the trainer's summary of its timed steps


def built(cfg: DictConfig) -> tuple[DataModule, Task]:
    """`cfg`'s data and model, seeded and built as `runner.run.run` builds them: the model by its
    own constructor, so that the hooks and parametrizations it sets up hold (a deep copy of a
    built model drops its tensor hooks), and the random state left where a run's build leaves it."""
    seed_everything(cfg.seed)
    return build(cfg)


def workspace(cfg: DictConfig, stack: ExitStack) -> tuple[torch.device, DataModule, Task, RunLog]:
    """`cfg`'s device, and its data and model built and seeded as a run builds them, and a
    throwaway RunLog (in a temporary folder that `stack` removes) for the timings to log to."""
    device = resolve_device(cfg.trainer.device)
    data, task = built(cfg)
    log = RunLog(Path(stack.enter_context(tempfile.TemporaryDirectory())))
    stack.callback(log.finish, {})
    return device, data, task, log


def prepared(cfg: DictConfig, task: Task, device: torch.device, stack: ExitStack):
    """`cfg`'s model with `task`'s weights, built (`built`) and prepared as `runner.run.run`
    builds and prepares it: its precision (closed by `stack`, in reverse order, so the first
    restores the process's settings last), fp32 islands, fp16_master's master weights,
    torch.compile where cfg.trainer.compile. Returns (task, precision)."""
    precision = Precision(cfg.precision, device)
    stack.callback(precision.close)
    _, variant = built(cfg)
    variant.load_state_dict(task.state_dict())
    variant.to(device)
    precision.prepare(variant, cfg.precision.fp32_modules)
    if cfg.trainer.compile:
        variant.compile()
    return variant, precision


def trainer_timer(
    cfg: DictConfig,
    task: Task,
    data: DataModule,
    precision: Precision,
    log: RunLog,
    warmup: int,
    steps: int,
) -> Timer:
    """Times `task` through `Trainer.fit`, wired as `runner.run.run` wires it: each call fits
    `warmup` more steps, then `steps` timed ones in one logging interval, and returns the
    trainer's summary (samples/s, step time; the peak memory of this call on CUDA) and `memory`
    as summary.json has it. No evaluation, no checkpoints; the call's warnings (an input-bound
    window) are not printed."""
    groups = precision.optimizer_groups(task.parameter_groups())
    optimizers, schedulers = build_optimizers(cfg.optim, groups, cfg.trainer.max_steps)
    timing = OmegaConf.merge(
        cfg.trainer,
        {
            "log_every_n_steps": warmup + steps,  # an interval ends at the warm-up and the end
            "val_check_interval": 0,
            "checkpoint_every_n_steps": 0,
            "progress_bar": False,
            "benchmark": {"warmup_steps": warmup},
        },
    )
    trainer = Trainer(timing, task, data, precision, optimizers, schedulers, log, precision.device)
    trainer.checkpointer.save = lambda *args: None  # a timing keeps no last.pt
    trainer.errors.enabled = False  # nor its matmuls' error: its memory and time are the run's

    def fit() -> dict:
        precision.in_force.set_matmuls()  # each variant's while it runs (TF32 is process-wide)
        reset_peak_memory(precision.device)
        timing.max_steps = trainer.step + warmup + steps
        trainer.meter.rows.clear()  # this call's speed and contention, not earlier calls' too
        quiet, console.console.quiet = console.console.quiet, True
        try:
            return trainer.fit() | {"memory": trainer_memory(trainer)}
        finally:
            console.console.quiet = quiet

    return fit
