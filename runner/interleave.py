"""Speed you can trust: variants of a training step timed in one process, in short rounds that
alternate their order on the same batches, so that drift on a shared machine (another job, clocks,
caches) hits every variant alike. The comparison's `runner.speed=interleaved` and
scripts/bench.py time through here.

Each timing fits `warmup` untimed steps, then `steps` timed ones as one logging interval, through
`Trainer.fit` as a run takes them (the first timing's first step is the eager precision audit).
Figures are medians over rounds, their spread the interquartile range over rounds, and ratios the
medians of per-round ratios: pairs timed in the same round, so drift between rounds cancels out.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
from collections.abc import Callable, Hashable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from runner import console
from runner.config import RunnerConfig
from runner.errors import first_line
from runner.optim import build_optimizers
from runner.precision import Precision
from runner.run import build, resolve_device, seed_everything
from runner.task import DataModule, Task
from runner.telemetry import reset_peak_memory
from runner.tracking import RunLog
from runner.trainer import Trainer

if TYPE_CHECKING:
    from runner.compare import Job

WARMUP_STEPS = 2  # untimed steps before each timing: the data loader starting, caches warming

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
Timer = Callable[[], dict]  # one timing: the trainer's summary of its timed steps


def workspace(cfg: DictConfig, stack: ExitStack) -> tuple[torch.device, DataModule, Task, RunLog]:
    """`cfg`'s device, and its data and model built and seeded as a run builds them, and a
    throwaway RunLog (in a temporary folder that `stack` removes) for the timings to log to."""
    device = resolve_device(cfg.trainer.device)
    seed_everything(cfg.seed)
    data, task = build(cfg)
    log = RunLog(Path(stack.enter_context(tempfile.TemporaryDirectory())))
    stack.callback(log.finish, {})
    return device, data, task, log


def prepared(cfg: DictConfig, task: Task, device: torch.device, stack: ExitStack):
    """A copy of `task` as `runner.run.run` prepares it for `cfg`: its precision (closed by
    `stack`, in reverse order, so the first restores the process's settings last), fp32 islands,
    fp16_master's master weights, torch.compile where cfg.trainer.compile. Returns (task, precision)."""
    precision = Precision(cfg.precision, device)
    stack.callback(precision.close)
    variant = copy.deepcopy(task).to(device)
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
    trainer's summary (samples/s, step time; the peak memory of this call on CUDA). No evaluation,
    no checkpoints; the call's warnings (an input-bound window) are not printed."""
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

    def fit() -> dict:
        # Each variant's matmul setting while it runs (TF32 is process-wide).
        tf32 = precision.mode == "tf32"
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32
        reset_peak_memory(precision.device)
        timing.max_steps = trainer.step + warmup + steps
        quiet, console.console.quiet = console.console.quiet, True
        try:
            return trainer.fit()
        finally:
            console.console.quiet = quiet

    return fit


def alternate(
    timers: dict[K, Callable[[], T]],
    rounds: int,
    each: Callable[[int, K, T], None] | None = None,
) -> dict[K, list[T]]:
    """Every timer once a round, in the order given on even rounds and reversed on odd ones;
    `each(round, key, result)` after each timing. Returns each timer's results, by round."""
    results: dict[K, list[T]] = {key: [] for key in timers}
    for r in range(rounds):
        for key in list(timers) if r % 2 == 0 else reversed(list(timers)):
            results[key].append(timers[key]())
            if each is not None:
                each(r, key, results[key][-1])
    return results


def median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """The median of the per-round ratios a/b."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def time_configs(
    configs: dict[K, DictConfig], rounds: int, steps: int, warmup: int = WARMUP_STEPS
) -> dict[K, dict]:
    """Variants that differ only by precision (e.g. the jobs of one comparison group), each
    built once from its config on the first config's data and initial weights, timed in
    alternating rounds. Per variant: samples_per_s and step_time_s (medians over rounds),
    samples_per_s_iqr (over rounds), samples_per_s_rounds, speedup (against the first variant:
    the median of per-round ratios) and peak_memory_mb (the most of any round)."""
    with ExitStack() as stack:
        device, data, task, log = workspace(next(iter(configs.values())), stack)
        timers = {}
        for key, cfg in configs.items():
            variant, precision = prepared(cfg, task, device, stack)
            timers[key] = trainer_timer(cfg, variant, data, precision, log, warmup, steps)
        results = alternate(timers, rounds)
    base = [s["samples_per_s"] for s in next(iter(results.values()))]
    figures = {}
    for key, summaries in results.items():
        rates = [s["samples_per_s"] for s in summaries]
        figures[key] = {
            "samples_per_s": statistics.median(rates),
            "samples_per_s_iqr": float(np.subtract(*np.percentile(rates, [75, 25]))),
            "samples_per_s_rounds": rates,
            "step_time_s": statistics.median(s["step_time_s"] for s in summaries),
            "speedup": median_ratio(rates, base),
            "peak_memory_mb": max(s["peak_memory_mb"] for s in summaries),
        }
    return figures


def time_sweep(jobs: list[Job], settings: RunnerConfig) -> dict[tuple, dict]:
    """A sweep's comparison groups timed again (runner.speed=interleaved): each setting's
    precisions, from the first completed job of each, by `time_configs`; the figures by
    (precision, setting). A setting without fp32 and another precision, run on several ranks
    (the timing is one process), or whose timing fails keeps its jobs' own figures."""
    chosen: dict[tuple, dict[str, Job]] = {}
    for job in jobs:
        if job.summary.get("status") == "completed" and job.config:
            chosen.setdefault(job.setting, {}).setdefault(job.precision, job)
    timings = {}
    shared = set.intersection(*(set(setting) for setting in chosen)) if chosen else set()
    for setting, by_precision in chosen.items():
        if "fp32" not in by_precision or len(by_precision) < 2:
            continue
        order = sorted(by_precision, key=lambda p: p != "fp32")  # fp32 first: the speedups' base
        where = " ".join(o for o in setting if o not in shared) or "the sweep"
        if any((by_precision[p].summary.get("world_size") or 1) > 1 for p in order):
            console.say(
                f"[yellow]warning:[/] {where} ran on several ranks: the jobs' speed is used"
            )
            continue
        console.say(
            f"timing {', '.join(order)} again ({where}): {settings.speed_rounds} interleaved "
            f"rounds of {settings.speed_steps} steps"
        )
        configs = {
            p: OmegaConf.load(by_precision[p].folder / ".hydra" / "config.yaml") for p in order
        }
        try:
            figures = time_configs(configs, settings.speed_rounds, settings.speed_steps)
        except Exception as e:  # the comparison still stands on the jobs' own figures
            console.say(
                f"[yellow]warning:[/] interleaved timing failed ({first_line(e)}): "
                "the jobs' speed is used"
            )
            continue
        timings |= {(p, setting): figures[p] for p in order}
    return timings
