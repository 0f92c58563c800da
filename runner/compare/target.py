"""Time to target: what a user pays to reach a loss, not the speed of a step (issue 31).

The target is a value of an evaluation metric (`compare.target_metric`, eval_loss by default;
lower is better for losses, perplexities and errors, higher for the rest, unless
`compare.target_direction` says). By default it is the baseline row's final value of that
metric, the mean over its seeds, loosened by the comparison's tolerance (2%: what the loss
verdict already counts as the same convergence), so that every seed of the baseline, and any
mode that converges as it does, reaches it before the run ends; `compare.target=<value>` sets
one of a user's own, for every row.

Per job: its evaluations of the metric (metrics.jsonl's rows that carry it), smoothed by a
centred mean over SMOOTHING evaluations (narrowed symmetrically at the ends, so a straight
line stays itself and the last evaluation is its own); the first smoothed evaluation at or past
the target, and the step where the curve crosses it, interpolated linearly from the evaluation
before; the samples, tokens and wall time (the run's own clock: the sum of its steps' times, no
evaluation in it) at that step, interpolated the same way. A curve that never reaches it is "not
reached", with the closest it came; one that reaches it with fewer than MIN_EVALS evaluations
before is "too sparse" to time, and the verdict asks for a denser trainer.val_check_interval.

Time to target = steps to target × the row's step time: the interleaved timing's where the sweep
has it (runner/compare/interleave.py), else each job's own median step time (its steady window),
else the run's own clock at the crossing; `time_source` says which. Over seeds: the mean and its
95% interval (Student's t). Against the baseline, seed by seed (same seed: same weights and data
order): `steps_to_target_ratio` (the row's steps over the baseline's: convergence per step, which
a faster step cannot buy back) and `time_to_target_speedup`, the step speedup over that ratio
(the speedup column's: the median of the interleaved rounds' ratios, so drift between rounds
cancels, else the job's own against its twin's), so that x× the step speed at r× the steps is
x/r× as fast to the target; each the geometric mean over seeds with its interval on the
logarithms. Every interval carries every spread measured: where the step time comes from the
interleaved rounds, the variance of its logarithm over the rounds adds to the seeds' (Welch–
Satterthwaite's degrees of freedom), so a constant step time cannot make an interval narrower
than the timing allows.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

from runner.compare.crossing import TargetSpec, _job_time, choose, clock, evaluations, reach, smooth
from runner.compare.stats import CONFIDENCE, as_float, log_interval, mean_ci, ratio_ci, spread

if TYPE_CHECKING:
    from runner.compare.groups import Group

DENSITY = 8  # the evaluations before the target that the suggested val_check_interval gives
# The keys a row's figures gain here (NaN or None where not measured: every row has them all).
FIGURES = (
    "steps_to_target",
    "samples_to_target",
    "tokens_to_target",
    "wall_time_to_target_s",
    "time_to_target_s",
    "time_to_target_speedup",
    "steps_to_target_ratio",
    "target_closest",
)


def _status(results: list[dict]) -> str:
    statuses = [r["status"] for r in results]
    if not statuses or all(s == "no curve" for s in statuses):
        return "no curve"
    for status in ("diverged", "not reached", "no curve", "too sparse"):
        if status in statuses:
            return status
    return "reached"


def measure(
    groups: list[Group], spec: TargetSpec, tolerance: float, first: frozenset | None = None
) -> None:
    """Every row's time-to-target figures (FIGURES and their intervals, `target`,
    `target_status`, ...), each job's in `job.reach`. Rows first measure themselves, then
    each is paired with its baseline's job of the same seed. `first`: a runner.seeds=auto
    sweep's first look's seeds, the only ones a default target is taken from."""
    for g in groups:
        value, source = choose(g.base, spec, tolerance, first)
        f = g.figures
        f |= {
            "target": value if math.isfinite(value) else math.nan,
            "target_metric": spec.metric,
            "target_direction": "lower" if spec.lower else "higher",
            "target_from": source,
        }
        f |= dict.fromkeys(FIGURES, math.nan)
        for key in ("steps_to_target", "time_to_target_s", "time_to_target_speedup"):
            f[f"{key}_ci_low"] = f[f"{key}_ci_high"] = math.nan
        f["steps_to_target_ratio_ci_low"] = f["steps_to_target_ratio_ci_high"] = math.nan
        # the seeds each paired figure used: those both it and the baseline's twin timed
        f["steps_to_target_ratio_pairs"] = f["time_to_target_speedup_pairs"] = 0
        f |= {"target_status": "no target", "time_source": None, "evals_before_target": None}
        f |= {"target_seeds_reached": 0, "target_sparse_seed": None, "target_missed_seeds": []}
        if not math.isfinite(value):
            for job in g.jobs:
                job.reach = None
            continue
        results = []
        for job in g.counted:
            r = reach(job, spec, value)
            r["time_s"], r["time_source"] = _job_time(g, job, r["step"], r["wall_s"])
            job.reach = r
            results.append(r)
        timed = [r for r in results if r["status"] in ("reached", "too sparse")]
        f["target_status"] = _status(results)
        f["target_seeds_reached"] = len(timed)
        level = f.get("confidence", CONFIDENCE)
        for key, name in (
            ("step", "steps_to_target"),
            ("samples", "samples_to_target"),
            ("tokens", "tokens_to_target"),
            ("wall_s", "wall_time_to_target_s"),
            ("time_s", "time_to_target_s"),
        ):
            mean, low, high = mean_ci((r[key] for r in timed), level)
            if key == "time_s" and {r["time_source"] for r in timed} == {"interleaved"}:
                mean, low, high = _timed(mean, [r["step"] for r in timed], _rounds(f), level)
            f[name] = mean
            if f"{name}_ci_low" in f:
                f[f"{name}_ci_low"], f[f"{name}_ci_high"] = low, high
        sources = {r["time_source"] for r in timed}
        f["time_source"] = sources.pop() if len(sources) == 1 else ("mixed" if sources else None)
        befores = [r["evals_before"] for r in timed]
        f["evals_before_target"] = min(befores) if befores else None
        sparse = [(j, j.reach) for j in g.counted if j.reach["status"] == "too sparse"]
        if sparse:
            f["target_sparse_seed"] = sparse[0][0].config.get("seed")
        f["target_missed_seeds"] = [
            j.config.get("seed") for j in g.counted if j.reach["status"] == "not reached"
        ]
        missed = [r["closest"] for r in results if r["status"] == "not reached"]
        sign = 1 if spec.lower else -1
        if missed:  # the seed that came closest of those that never reached it
            f["target_closest"] = min(missed, key=lambda v: sign * v)


def _rounds(f: dict) -> list[float]:
    """The logarithms of the row's interleaved rounds' samples/s (none where not timed so)."""
    rounds = f.get("samples_per_s_rounds") or []
    return [math.log(x) for x in rounds if x > 0]


def _timed(mean_time: float, steps: list[float], rounds: list[float], level: float) -> tuple:
    """The mean time to target (mean steps × the interleaved step time) and its interval on
    the log scale, which adds the spread of the steps over seeds and of the step time over the
    timing rounds."""
    if len(steps) < 2 or not math.isfinite(mean_time) or mean_time <= 0:
        return mean_time, math.nan, math.nan
    relative = statistics.stdev(steps) / math.sqrt(len(steps)) / statistics.fmean(steps)
    parts = [(relative**2, len(steps) - 1)] + ([spread(rounds)] if rounds else [])
    return log_interval(math.log(mean_time), parts, level)


def pair(groups: list[Group]) -> None:
    """Each row's time_to_target_speedup and steps_to_target_ratio against its baseline's job
    of the same seed, where both timed the target: the steps ratio r, and the step speedup
    over it (the interleaved rounds' median ratio, else the job's own against its twin's), so
    that a row r× the steps and x× the step speed is x/r× as fast to the target."""
    for g in groups:
        _paired(g)


def _paired(g: Group) -> None:
    f, base = g.figures, g.base
    if base is None or not math.isfinite(f["target"]):
        return
    if g is base:
        if f["target_status"] in ("reached", "too sparse"):
            f["time_to_target_speedup"] = f["steps_to_target_ratio"] = 1.0
        return
    twins = {j.config.get("seed"): j for j in base.counted if getattr(j, "reach", None)}
    interleaved = f.get("speed_source") == "interleaved"
    speedups, ratios = [], []
    for job in g.counted:
        twin = twins.get(job.config.get("seed"))
        ours, theirs = job.reach, twin.reach if twin is not None else None
        timed = ("reached", "too sparse")
        if theirs is None or ours["status"] not in timed or theirs["status"] not in timed:
            continue
        ratio = ours["step"] / theirs["step"] if theirs["step"] else math.nan
        ratios.append(ratio)
        # per-job timing: this seed's own speedup against its twin's (runner/compare/sweep.py's
        # _job_figures), whose spread the seeds then carry
        speedups.append(job.figures["speedup"] / ratio if ratio else math.nan)
    level = f.get("confidence", CONFIDENCE)
    f["steps_to_target_ratio"], *ends = ratio_ci(ratios, level)
    f["steps_to_target_ratio_ci_low"], f["steps_to_target_ratio_ci_high"] = ends
    key = "time_to_target_speedup"
    inverse = [1 / r for r in ratios if r]
    if interleaved:  # the rounds' speedup (drift cancels) over the steps ratio: both spreads
        ours, theirs = _rounds(f), _rounds(base.figures)
        timing = [a - b for a, b in zip(ours, theirs, strict=True)] if ours and theirs else []
        f[key], f[f"{key}_ci_low"], f[f"{key}_ci_high"] = ratio_ci(
            inverse, level, f["speedup"], timing
        )
    else:
        f[key], f[f"{key}_ci_low"], f[f"{key}_ci_high"] = ratio_ci(speedups, level)
    for name, values in (
        ("steps_to_target_ratio", ratios),
        (key, inverse if interleaved else speedups),
    ):
        f[f"{name}_pairs"] = len([v for v in values if math.isfinite(v) and v > 0])


def interval_for(g: Group) -> int:
    """A trainer.val_check_interval that puts about DENSITY evaluations before the earliest
    crossing of the row or its baseline."""
    steps = [
        j.reach["step"]
        for x in filter(None, (g, g.base))
        for j in x.counted
        if getattr(j, "reach", None) and math.isfinite(j.reach["step"])
    ]
    return max(1, int(min(steps, default=DENSITY) // DENSITY))


def curve(g: Group, spec_metric: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """For the dashboard: steps, the mean smoothed eval curve over the row's good seeds, the
    time at each (steps × its step time, as its time to target takes it; the run's clock where
    it has no step time) and the samples or tokens seen by then (tokens where the data has
    them)."""
    by_step: dict[int, list[tuple[float, float, float]]] = {}
    for job in g.counted:
        steps, values = evaluations(job, spec_metric)
        table = clock(job.rows)
        for s, v in zip(steps, smooth(values), strict=True):
            seconds, samples, tokens = table.get(s, (math.nan,) * 3)
            timed, _ = _job_time(g, job, s, seconds)
            count = tokens if math.isfinite(tokens) else samples
            by_step.setdefault(s, []).append((v, timed, count))
    steps = sorted(by_step)
    mean = [[sum(p[i] for p in by_step[s]) / len(by_step[s]) for s in steps] for i in range(3)]
    return steps, *mean


def uses_tokens(g: Group) -> bool:
    return any(math.isfinite(as_float(j.summary.get("tokens_per_s") or math.nan)) for j in g.jobs)


# compare.md's columns (after the speed's): the time to target and what it is made of.
COLUMNS = [
    ("time to target", "time_to_target_s", "{:.3g} s"),
    ("to target", "time_to_target_speedup", "{:.2f}×"),
    ("steps to target", "steps_to_target", "{:.1f}"),
    ("steps ratio", "steps_to_target_ratio", "{:.2f}×"),
    ("tokens to target", "tokens_to_target", "{:.0f}"),
]
UNTIMED = {
    "diverged": "diverged",
    "not reached": "not reached",
    "too sparse": "untested",
    "no curve": "untested",
}


def columns(groups: list[Group]) -> list[tuple[str, str, str]]:
    """COLUMNS, with samples for tokens where the data has no tokens; none where no row has a
    target."""
    if not any(math.isfinite(g.figures.get("target", math.nan)) for g in groups):
        return []
    tokens = any(math.isfinite(g.figures.get("tokens_to_target", math.nan)) for g in groups)
    if tokens:
        return COLUMNS
    return COLUMNS[:-1] + [("samples to target", "samples_to_target", "{:.0f}")]


def cell(g: Group, key: str) -> str | None:
    """A target column's cell where its status speaks instead of a figure ("not reached",
    "untested" for a curve too sparse or missing); None where the figure is to be shown."""
    status = g.figures.get("target_status")
    if key in {k for _, k, _ in COLUMNS} | {"samples_to_target"} and status in UNTIMED:
        if status in ("not reached", "diverged") or key in (
            "time_to_target_s",
            "time_to_target_speedup",
        ):
            return UNTIMED[status]
    return None
