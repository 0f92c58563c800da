"""A run's speed figures from its logged rows: the steady window's throughput and step time, their
spread, the share spent waiting for data, and what the run got of the machine meanwhile
(runner/measure/contention.py): contended windows are left out where most were clean, and where
most were contended the speed is said to be, and is untested."""

from __future__ import annotations

import math
import statistics

from runner import console
from runner.measure.contention import describe

INPUT_BOUND_SHARE = 0.2  # above this share of step time spent waiting for data, warn
# The figures of a timed window (runner/measure/contention.py's `contention`), kept in each row
WINDOW_KEYS = (
    "cpu_share",
    "worst_thread_share",
    "cpu_of_threads",
    "others_runnable",
    "contended",
    "gpu_others",
    "gpu_others_sm",
    "gpu_utilization",
)
QUIETLY = "time it on a quiet machine"
HOW_TO_TIME = f"{QUIETLY}, or compare with runner.speed=interleaved"


def _iqr(values: list[float]) -> float:
    """The interquartile range (linear interpolation between the values, as numpy's default)."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


def windows(rows: list[dict]) -> list[list[dict]]:
    """The rows by timed window: an interval's steps share its mean time, so a new time, or a gap
    in the steps, starts one."""
    out: list[list[dict]] = []
    for row in rows:
        same = out and out[-1][-1]["step_time_s"] == row["step_time_s"]
        if same and out[-1][-1]["step"] + 1 == row["step"]:
            out[-1].append(row)
        else:
            out.append([row])
    return out


def _contention(steady: list[list[dict]], contended: list[list[dict]], shown) -> dict:
    """summary.json's `contention`: over the windows `shown` (those the speed is taken over),
    the median CPU shares, the least share of a busy thread, the most other runnable tasks; and
    of the steady windows, how many were contended."""

    def each(key: str) -> list:
        return [w[0][key] for w in shown if w[0].get(key) is not None]

    middle = {k: statistics.median(v) if (v := each(k)) else None for k in WINDOW_KEYS[:3]}
    found = middle | {
        "worst_thread_share": min(each("worst_thread_share"), default=None),
        "others_runnable": max(each("others_runnable"), default=None),
        "gpu_others": max(each("gpu_others"), default=None),
        "windows": len(steady),
        "contended_windows": len(contended),
        "measured": any(w[0].get("contended") is not None for w in steady),
    }
    return found | {"words": describe(found)}


def steady_speed(rows: list[dict], warmup: int) -> dict:
    """Median throughput, median and p90 step time, and the share of step time spent waiting
    for data, over the steady window: the rows past their attempt's warm-up (`steady`; rows
    written before that flag, past the run's first `warmup` steps). The spread: the
    interquartile ranges of throughput and step time over the window's steps, which are timed
    by interval; None where the window has fewer than two intervals to compare. Contended
    windows are left out where at least half were clean; else the speed is contended
    (`speed_contended`), said in `speed_note`, and untested."""
    steady = [r for r in rows if r.get("steady", r["step"] > warmup)]
    if not steady:
        # The warm-up holds the eager audit and fp16's fp32 probe: its speed would mislead.
        keys = ("samples_per_s", "samples_per_s_iqr", "tokens_per_s", "step_time_s")
        keys += ("step_time_s_iqr", "step_time_p90_s", "data_wait_share")
        return dict.fromkeys(keys) | {
            "speed_intervals": 0,
            "speed_contended": None,
            "speed_note": f"no steady window: the run ended within its {warmup}-step warm-up "
            "(trainer.benchmark.warmup_steps), so its speed is untested",
        }
    parts = windows(steady)
    contended = [w for w in parts if w[0].get("contended")]
    clean = [w for w in parts if not w[0].get("contended")]
    used, figures = parts, {}
    if contended and 2 * len(clean) >= len(parts):
        used = clean
        figures["speed_note"] = (
            f"{len(contended)} of {len(parts)} timed windows were contended (another process "
            "held the run's cores): left out of the speed figures"
        )
    speed_contended = used is parts and bool(contended)
    measured = _contention(parts, contended, contended if speed_contended else used)
    figures |= {"contention": measured, "speed_contended": speed_contended}
    if not measured["measured"]:
        figures["speed_contended"] = None  # no per-thread accounts here: unmeasured
    elif figures["speed_contended"]:
        figures["speed_note"] = (
            f"contended: {measured['words']} in {len(contended)} of its "
            f"{len(parts)} timed windows; its speed is untested: {HOW_TO_TIME}"
        )
    return _figures([r for w in used for r in w], len(used)) | figures


def _figures(steady: list[dict], intervals: int) -> dict:
    times = [r["step_time_s"] for r in steady]
    throughput = [r["samples_per_s"] for r in steady]
    wait_share = sum(r["data_wait_s"] for r in steady) / max(sum(times), 1e-12)
    if wait_share > INPUT_BOUND_SHARE:
        console.say(
            f"[yellow]warning:[/] input-bound: {wait_share:.0%} of step time waits for data, "
            "which no precision speeds up; raise dataset.num_workers or make loading cheaper"
        )
    return {
        "samples_per_s": statistics.median(throughput),
        "samples_per_s_iqr": _iqr(throughput) if intervals > 1 else None,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "step_time_s": statistics.median(times),
        "step_time_s_iqr": _iqr(times) if intervals > 1 else None,
        # Nearest rank: one of the measured times, never below the median.
        "step_time_p90_s": sorted(times)[math.ceil(0.9 * len(times)) - 1],
        "speed_intervals": intervals,
        "data_wait_share": wait_share,
    }
