"""Speed you can trust: variants of a training step timed in one process, in short rounds that
alternate their order on the same batches, so that drift on a shared machine (another job, clocks,
caches) hits every variant alike. The comparison's `runner.speed=interleaved` and
scripts/bench.py time through here.

Each timing fits `warmup` untimed steps, then `steps` timed ones as one logging interval, through
`Trainer.fit` as a run takes them (the first timing's first step is the eager precision audit).
Figures are medians over rounds, their spread the interquartile range over rounds, and ratios the
per-round ratios (pairs timed in the same round, so drift between rounds cancels out) in a
geometric mean that weights each order alike (stats.round_ratio), so that drift within a round,
which favours one order, cancels too, with an odd count of rounds as with an even one.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable
from contextlib import ExitStack
from typing import TYPE_CHECKING, TypeVar

import numpy as np
from omegaconf import DictConfig, OmegaConf

from runner import console
from runner.compare.stats import round_ratio
from runner.config import RunnerConfig
from runner.errors import first_line
from runner.train.session import prepared, trainer_timer, workspace

if TYPE_CHECKING:
    from runner.compare.groups import Group
    from runner.compare.jobs import Job

WARMUP_STEPS = 2  # untimed steps before each timing: the data loader starting, caches warming

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


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


def time_configs(
    configs: dict[K, DictConfig], rounds: int, steps: int, warmup: int = WARMUP_STEPS
) -> dict[K, dict]:
    """Variants that differ only by precision (e.g. the jobs of one comparison group), each
    built once from its config on the first config's data and initial weights, timed in
    alternating rounds. Per variant: samples_per_s and step_time_s (medians over rounds),
    samples_per_s_iqr (over rounds), samples_per_s_rounds, speedup (against the first variant:
    per-round ratios, each order weighted alike), peak_memory_mb (the most of any round), and
    what each round got of the machine: a contended round is timed again (`clean_rounds`),
    and where one stays contended, so is the speed (`speed_contended`)."""
    with ExitStack() as stack:
        device, data, task, log = workspace(next(iter(configs.values())), stack)
        timers = {}
        for key, cfg in configs.items():
            variant, precision = prepared(cfg, task, device, stack)
            timers[key] = trainer_timer(cfg, variant, data, precision, log, warmup, steps)
        results, redone = clean_rounds(timers, rounds)
    base = [s["samples_per_s"] for s in next(iter(results.values()))]
    # a round is contended where any variant's was (its ratios pair them), unjudged where none was
    by_round = [
        _contended([s[r].get("speed_contended") for s in results.values()]) for r in range(rounds)
    ]
    figures = {}
    for key, summaries in results.items():
        rates = [s["samples_per_s"] for s in summaries]
        figures[key] = {
            "samples_per_s": statistics.median(rates),
            "samples_per_s_iqr": float(np.subtract(*np.percentile(rates, [75, 25]))),
            "samples_per_s_rounds": rates,
            "step_time_s": statistics.median(s["step_time_s"] for s in summaries),
            "speedup": round_ratio(rates, base),
            "peak_memory_mb": max(s["peak_memory_mb"] for s in summaries),
            # each round's share of the machine (runner/measure/contention.py), and the rounds
            # timed again for being contended; a round still contended leaves the speed so
            "cpu_share_rounds": [(s.get("contention") or {}).get("cpu_share") for s in summaries],
            "rounds_redone": redone,
            "speed_contended": _contended(by_round),
            "contention": next(
                (
                    (s.get("contention") or {}).get("words")
                    for s in summaries
                    if s.get("speed_contended")
                ),
                None,
            ),
        }
    return figures


def clean_rounds(timers: dict[K, Callable[[], dict]], rounds: int) -> tuple[dict, int]:
    """`alternate`'s rounds, each timed again, in the same order, where any of its timings was
    contended (another process held the cores), up to `rounds` times in all; a round still
    contended after that stays, and the figures say so. Returns (results, rounds redone)."""
    results: dict = {key: [] for key in timers}
    redone = 0
    for r in range(rounds):
        order = dict(reversed(list(timers.items()))) if r % 2 else timers
        while True:
            got = alternate(order, 1)
            if not any(s[0].get("speed_contended") for s in got.values()) or redone >= rounds:
                break
            redone += 1
        for key in timers:
            results[key].append(got[key][0])
    return results, redone


def _stages(cfg: DictConfig, steps: int) -> list[tuple[DictConfig, int]]:
    """(config, steps) per stage a job ran: a staged job's stages as plain modes, with the
    optimizer steps each covered (stage i runs the steps before its until_step), else the job."""
    if cfg.precision.mode != "staged":
        return [(cfg, steps)]
    parts, start = [], 0
    for stage in cfg.precision.stages:
        until = stage.get("until_step")
        end = steps if until is None else min(until, steps)
        if end > start:
            plain = OmegaConf.merge(cfg, {"precision": {"mode": stage.mode, "stages": []}})
            parts.append((plain, end - start))
        start = max(start, end)
    return parts


def _by_steps(parts: list[tuple[dict, int]]) -> dict:
    """A staged row's figures from its stages' (figures, steps): each round's rate the samples
    over the time its stages take for their shares of the steps."""
    total = sum(n for _, n in parts)
    rates = [
        1 / sum(n / total / f["samples_per_s_rounds"][r] for f, n in parts)
        for r in range(len(parts[0][0]["samples_per_s_rounds"]))
    ]
    return {
        "samples_per_s": statistics.median(rates),
        "samples_per_s_iqr": float(np.subtract(*np.percentile(rates, [75, 25]))),
        "samples_per_s_rounds": rates,
        "step_time_s": sum(n / total * f["step_time_s"] for f, n in parts),
        "peak_memory_mb": max(f["peak_memory_mb"] for f, _ in parts),
        "speed_contended": _contended([f.get("speed_contended") for f, _ in parts]),
        "contention": next((f["contention"] for f, _ in parts if f.get("contention")), None),
    }


def time_sweep(groups: list[Group], settings: RunnerConfig) -> dict[tuple, dict]:
    """A sweep's rows timed again (runner.speed=interleaved): each setting's rows, baselines
    first, from the first completed job of each, by `time_configs`; the figures by row key. A
    staged row is timed stage by stage (each stage's mode from its own first step), its figures
    weighted by the steps each stage ran. A setting of one row, run on several ranks (the timing
    is one process), or whose timing fails keeps its jobs' own figures."""
    chosen: dict[tuple, list[tuple[Group, Job]]] = {}
    for g in groups:
        job = next((j for j in g.jobs if j.summary.get("status") == "completed" and j.config), None)
        if job is not None:
            chosen.setdefault(g.setting, []).append((g, job))
    timings = {}
    shared = set.intersection(*(set(setting) for setting in chosen)) if chosen else set()
    for setting, rows in chosen.items():
        if len(rows) < 2:
            continue
        rows.sort(key=lambda row: row[0] is not row[0].base)  # a baseline's rounds come first
        where = " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in setting if (k, v) not in shared)
        where = where or "the sweep"
        if any((job.summary.get("world_size") or 1) > 1 for _, job in rows):
            console.say(
                f"[yellow]warning:[/] {where} ran on several ranks: the jobs' speed is used"
            )
            continue
        configs, steps = {}, {}
        for g, job in rows:
            cfg = OmegaConf.load(job.folder / ".hydra" / "config.yaml")
            if cfg.precision.get("fp32_modules") == "auto":  # the islands its search found
                cfg.precision.fp32_modules = job.summary["fp32_islands"]["fp32_modules"]
            ran = job.summary.get("steps") or cfg.trainer.max_steps
            for i, (part, n) in enumerate(_stages(cfg, ran)):
                configs[g.key, i], steps[g.key, i] = part, n
        names = ", ".join(
            g.label + (" (stage by stage)" if job.config["precision"]["mode"] == "staged" else "")
            for g, job in rows
        )
        console.say(
            f"timing {names} again ({where}): {settings.speed_rounds} interleaved "
            f"rounds of {settings.speed_steps} steps"
        )
        try:
            figures = time_configs(configs, settings.speed_rounds, settings.speed_steps)
        except Exception as e:  # the comparison still stands on the jobs' own figures
            console.say(
                f"[yellow]warning:[/] interleaved timing failed ({first_line(e)}): "
                "the jobs' speed is used"
            )
            continue
        redone = max(f.get("rounds_redone", 0) for f in figures.values())
        if any(f.get("speed_contended") for f in figures.values()):
            console.say(
                f"[yellow]warning:[/] {where}: rounds stayed contended after {redone} timed "
                "again (another process held the cores): these rows' speed is untested"
            )
        elif redone:
            console.say(f"{where}: {redone} contended rounds timed again")
        if any(f.get("speed_contended") is None for f in figures.values()):
            console.say(
                f"{where}: whether the machine was shared could not be told (rounds under "
                "50 ms, or no per-thread CPU accounts here): runner.speed_steps=N times longer"
            )
        for g, _ in rows:
            parts = [(figures[k], steps[k]) for k in configs if k[0] == g.key]
            timings[g.key] = parts[0][0] if len(parts) == 1 else _by_steps(parts)
    return timings


def _contended(verdicts: list[bool | None]) -> bool | None:
    """A timing's contention from its parts' (rounds', stages'): contended where one was, None
    where none could be judged (each too short, or unmeasured), else clean."""
    if any(verdicts):
        return True
    return None if all(v is None for v in verdicts) else False
