"""Where one job's eval curve reaches the comparison's target (runner/compare/target.py
aggregates these per row): the target's metric and direction, the evaluation where the curve,
smoothed by a centred mean over SMOOTHING evaluations, first reaches the target (so that one
lucky evaluation does not), the step where the curve crosses it (a quadratic fitted by least
squares to the FIT evaluations around that one: unbiased where the curve bends, as a smoothed
and linearly interpolated curve is not), the run's own clock there, the target chosen from the
baseline's seeds, and one job's time to the target by the best step time the row has."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.compare.stats import as_float, finite, percent

if TYPE_CHECKING:
    from runner.compare.groups import Group
    from runner.compare.jobs import Job

SMOOTHING = 3  # evaluations in the centred window of the smoothed eval curve
FIT = 4  # raw evaluations the crossing's quadratic is fitted to: 2 before, 2 from the crossing
MIN_EVALS = 4  # evaluations before the target, at least, to time when it is reached
LOWER_IS_BETTER = ("loss", "perplexity", "ppl", "error", "err", "wer", "cer", "mse", "mae")


@dataclass(frozen=True)
class TargetSpec:
    """What the comparison times: `value` None for the baseline's own final value."""

    value: float | None = None
    metric: str = "eval_loss"
    direction: str | None = None  # lower | higher; None: from the metric's name

    @property
    def lower(self) -> bool:
        if self.direction is not None:
            return self.direction == "lower"
        name = self.metric.lower()
        return any(word in name for word in LOWER_IS_BETTER)

    def words(self) -> str:
        return f"{self.metric.replace('_', ' ')} {'≤' if self.lower else '≥'}"


def smooth(values: list[float], window: int = SMOOTHING) -> list[float]:
    """Each value's centred mean over `window` values, the window narrowed symmetrically near
    the ends (the first and last values are their own)."""
    k, n = window // 2, len(values)
    out = []
    for i in range(n):
        h = min(k, i, n - 1 - i)
        chunk = values[i - h : i + h + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def evaluations(job: Job, metric: str) -> tuple[list[int], list[float]]:
    """The steps and values of the job's evaluations of `metric` (metrics.jsonl), an inf or
    NaN one (written as a string, or null) kept as such: a diverged evaluation."""
    points = [(r["step"], as_float(r.get(metric))) for r in job.rows if metric in r]
    return [s for s, _ in points], [v for _, v in points]


def diverged_evaluation(job: Job) -> str | None:
    """Where the job's evaluation first became inf or NaN, in words ("eval loss inf at step
    125"): a diverged seed, whatever its training loss did; None where every one is finite.
    A null evaluation in metrics.jsonl is JSON's NaN (as `evaluations` reads it); in
    summary.json, a figure not measured."""
    rows = [*job.rows, {"step": "the end", **job.summary}]
    for row in rows:
        for key, value in row.items():
            if not key.startswith("eval_") or isinstance(value, bool):
                continue
            if value is None and row["step"] == "the end":
                continue
            try:
                number = as_float(value)
            except (TypeError, ValueError):  # eval_error's message, eval_precisions' tables
                continue
            if not math.isfinite(number):
                where = f"step {row['step']}" if row["step"] != "the end" else "the end"
                return f"{key.replace('_', ' ')} {number} at {where}"
    return None


def clock(rows: list[dict]) -> dict[int, tuple[float, float, float]]:
    """Each step's cumulative (seconds, samples, tokens) over the steps up to it: the run's own
    clock (its steps' times; evaluation and checkpoints are not in them). NaN where a row lacks
    its timing; tokens NaN where the data has none."""
    seconds = samples = tokens = 0.0
    out = {}
    for r in sorted(rows, key=lambda r: r["step"]):
        dt = as_float(r.get("step_time_s"))
        seconds += dt
        samples += as_float(r.get("samples_per_s")) * dt
        tokens += as_float(r.get("tokens_per_s")) * dt
        out[r["step"]] = (seconds, samples, tokens if tokens > 0 else math.nan)
    return out


def _at(table: dict[int, tuple], step: float) -> tuple[float, ...]:
    """The clock at a (fractional) step, linear between the logged steps around it."""
    below = max((s for s in table if s <= step), default=None)
    above = min((s for s in table if s >= step), default=None)
    if below is None or above is None:
        return (math.nan,) * 3
    if below == above:
        return table[below]
    w = (step - below) / (above - below)
    return tuple(a + w * (b - a) for a, b in zip(table[below], table[above], strict=True))


def crossing_step(steps: list[int], values: list[float], hit: int, target: float) -> float:
    """The step where the curve crosses `target`, its smoothed form first there at evaluation
    `hit` (> 0): the root of a quadratic least-squares fit to the FIT raw evaluations around
    evaluation hit − 1 (the window shifted inside the curve), the root nearest that interval;
    where the fit has none within its evaluations, the raw curve interpolated linearly."""
    import numpy as np

    lo = min(max(0, hit - FIT // 2), max(0, len(steps) - FIT))
    s = np.asarray(steps[lo : lo + FIT], dtype=float)
    v = np.asarray(values[lo : lo + FIT], dtype=float)
    guess = (steps[hit - 1] + steps[hit]) / 2
    if len(s) >= 3:
        mid, half = (s[0] + s[-1]) / 2, (s[-1] - s[0]) / 2
        coef = np.polyfit((s - mid) / half, v - target, 2)
        roots = [r.real * half + mid for r in np.roots(coef) if abs(r.imag) < 1e-9]
        roots = [r for r in roots if s[0] <= r <= s[-1]]
        if roots:
            return float(min(roots, key=lambda r: abs(r - guess)))
    before, after = values[hit - 1], values[hit]
    share = (before - target) / (before - after) if before != after else 1.0
    return steps[hit - 1] + min(max(share, 0.0), 1.0) * (steps[hit] - steps[hit - 1])


def reach(job: Job, spec: TargetSpec, target: float) -> dict:
    """Where the job's smoothed eval curve first reaches `target`: status ("reached", "too
    sparse", "not reached", "no curve"), the step (interpolated), samples, tokens and wall
    time there, the evaluations before it, and the closest the curve came."""
    steps, values = evaluations(job, spec.metric)
    out = dict.fromkeys(("step", "samples", "tokens", "wall_s", "closest"), math.nan)
    out |= {"evals": len(steps), "evals_before": None}
    if not steps:
        return out | {"status": "no curve"}
    if not all(math.isfinite(v) for v in values):  # an inf or NaN evaluation: never timed
        return out | {"status": "diverged"}
    curve = smooth(values)
    sign = 1 if spec.lower else -1
    out["closest"] = min(curve, key=lambda v: sign * v)
    hit = next((i for i, v in enumerate(curve) if sign * (v - target) <= 0), None)
    if hit is None:
        return out | {"status": "not reached"}
    if hit == 0:  # at or before the first evaluation: when, no evaluation tells
        step = float(steps[0])
    else:
        step = crossing_step(steps, values, hit, target)
    seconds, samples, tokens = _at(clock(job.rows), step)
    status = "reached" if hit >= MIN_EVALS else "too sparse"
    return out | {
        "status": status,
        "step": step,
        "samples": samples,
        "tokens": tokens,
        "wall_s": seconds,
        "evals_before": hit,
    }


def final_value(job: Job, metric: str) -> float:
    """The job's last evaluation of `metric` (its curve's, else its summary's)."""
    _, values = evaluations(job, metric)
    return values[-1] if values else as_float(job.summary.get(metric))


def best_value(job: Job, spec: TargetSpec) -> float:
    """The best its smoothed curve of the target's metric came (the final value where it has
    no curve): any target at or short of it, this job reaches."""
    _, values = evaluations(job, spec.metric)
    if not values:
        return final_value(job, spec.metric)
    sign = 1 if spec.lower else -1
    return min(finite(smooth(values)), key=lambda v: sign * v, default=math.nan)


def choose(
    base: Group | None, spec: TargetSpec, tolerance: float, first: frozenset | None = None
) -> tuple[float, str]:
    """The target for the rows compared with `base`, and where it comes from (in words): the
    baseline's mean final value, or its worst seed's best where that is further, loosened by
    the tolerance; so every baseline seed reaches it, and so does a mode within the tolerance
    of each. `first`: a runner.seeds=auto sweep's first look's seeds, the only ones it is taken
    from, so that it never moves as the baseline gains seeds."""
    if spec.value is not None:
        return float(spec.value), f"compare.target={spec.value:g}"
    if base is None:
        return math.nan, "no baseline to take a target from"
    jobs = [j for j in base.counted if first is None or j.config.get("seed") in first]
    jobs = jobs or base.counted
    finals = finite(final_value(j, spec.metric) for j in jobs)
    if not finals:
        return math.nan, f"{base.label} has no {spec.metric} to take a target from"
    sign = 1 if spec.lower else -1
    value = mean = sum(finals) / len(finals)
    seeds = f"the mean of {len(finals)} seeds" if len(finals) > 1 else "one seed"
    words = f"{base.label}'s final {spec.metric.replace('_', ' ')} {mean:.4f} ({seeds})"
    bests = [(best_value(j, spec), j) for j in jobs]
    worst, job = max(
        ((v, j) for v, j in bests if math.isfinite(v)),
        key=lambda b: sign * b[0],
        default=(mean, None),
    )
    if sign * (worst - mean) > 0:  # a seed never gets as far as the mean: from its best
        value = worst
        words = (
            f"the best of {base.label} seed {job.config.get('seed', '?')}, {worst:.4f}, the "
            f"furthest of its seeds (their mean final: {mean:.4f})"
        )
    loose = value + sign * tolerance * abs(value)
    fixed = "; fixed at the first look" if first is not None else ""
    return loose, f"{words} {'+' if spec.lower else '−'}{percent(tolerance)} tolerance{fixed}"


def _job_time(g: Group, job: Job, step: float, wall_s: float) -> tuple[float, str]:
    """(time to target, its source) of one job: steps × the row's interleaved step time, else
    × the job's own median step time, else the run's own clock at the crossing."""
    f = g.figures
    if f.get("speed_source") == "interleaved" and math.isfinite(as_float(f.get("step_time_s"))):
        return step * f["step_time_s"], "interleaved"
    own = as_float(job.summary.get("step_time_s"))
    if math.isfinite(own):
        return step * own, "jobs"
    return wall_s, "clock"
