"""A sweep's jobs grouped by everything but the seed, and each group's verdict against fp32.

Per group (a precision in one setting): its figures over seeds (the losses' mean ± std, a typical
seed's median for the rest), its divergence rate (the share of seeds that failed, diverged or
overflowed), and its loss gap to fp32 in units of the seed-to-seed spread:

    gap_in_spreads = (mean - fp32's mean) / spread,
    spread = sqrt(((n1 - 1) s1² + (n2 - 1) s2²) / (n1 + n2 - 2)),

the pooled standard deviation of the two groups' losses over their good seeds (n seeds, sample
std s): the eval loss where every one of those seeds has one, else the final training loss. It
is positive where the loss is higher than fp32's and needs two good seeds on each side; with
fewer it is untested. The spread is at least SPREAD_FLOOR of the loss, so that seeds that agree
exactly (std 0) give 0 where the means agree and a very large gap where they do not.

A speed is measurably different from fp32's only where the two differ by more than their
interquartile ranges added; inside that, a mode is never recommended. The speed comes from each
job's own steady window (speed_source "jobs"), or, with runner.speed=interleaved, from the
precisions timed again side by side in one process (runner/interleave.py; "interleaved": medians
and IQR over rounds, the speedup the median of per-round ratios to fp32).

A step too small to show a precision effect is never recommended on its speed either. A
precision speeds up the matmuls and convolutions only, so the share of fp32's step they take
bounds what any mode can gain (Amdahl); where fp32's audited FLOPs would take under
MIN_MATMUL_SHARE of its measured step time at the device's fp32 matmul peak (its MFU), most of
the step is something no precision speeds up, and every mode of that setting is too small to tell.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.compare import Job

SEED_NOISE_SPREADS = 2.0  # a mean loss this many spreads above fp32's is beyond seed noise
SPREAD_FLOOR = 1e-6  # the least spread, relative to the loss
MIN_SPEEDUP = 1.05  # below this, a mode is not worth its risk over fp32
UNSTABLE = ("failed", "diverged", "overflow")  # job health that counts toward divergence_rate
PAIRED = ("speedup", "memory_saving", "max_loss_gap", "final_loss_gap", "health")
SPEED = ("samples_per_s", "samples_per_s_iqr", "samples_per_s_rounds", "step_time_s")
# The least share of fp32's step its FLOPs take at the device's fp32 matmul peak (flops_per_step
# over step_time_s, over peak_tflops: its MFU) for a speed to tell anything about precision. Small
# matmuls reach a tenth of the peak or so; under 5% at the peak, then, the matmuls and
# convolutions take under half the step even so, and the rest (kernel launches, Python,
# elementwise ops, the optimizer, data) runs the same in every precision.
MIN_MATMUL_SHARE = 0.05


@dataclass(eq=False)
class Group:
    """The jobs of one precision and setting, one per seed (one job where no seed is swept)."""

    jobs: list[Job]
    label: str
    verdict: str = ""
    figures: dict = field(default_factory=dict)

    @property
    def precision(self) -> str:
        return self.jobs[0].precision

    @property
    def setting(self) -> tuple:
        return self.jobs[0].setting

    @property
    def status(self) -> str:
        """ "completed", or the status of its first seed that did not complete."""
        statuses = (j.summary.get("status") for j in self.jobs)
        return next((s for s in statuses if s != "completed"), "completed")

    @property
    def unstable(self) -> list[Job]:
        return [j for j in self.jobs if j.figures["health"] in UNSTABLE]

    @property
    def counted(self) -> list[Job]:
        """The seeds its figures come from: those that neither failed nor diverged, else all."""
        return [j for j in self.jobs if j.figures["health"] not in UNSTABLE] or self.jobs


def _finite(values) -> list:
    return [v for v in values if v is not None and math.isfinite(v)]


def median(values) -> float:
    """A typical seed's figure (a count stays one of the counts); NaN where none is known."""
    values = _finite(values)
    if not values:
        return math.nan
    if all(isinstance(v, int) for v in values):
        return statistics.median_low(values)
    return statistics.median(values)


def _mean_std(values) -> tuple[float, float]:
    values = _finite(values)
    mean = statistics.fmean(values) if values else math.nan
    return mean, statistics.stdev(values) if len(values) > 1 else math.nan


def memory_figure(summary: dict) -> tuple[float, str]:
    """(MB, what it is) for the memory saving: CUDA's measured peak; on a CPU the accounted total
    of summary.json's `memory` (a CPU process's peak is not one job's: a sweep's later jobs
    inherit it); for a summary from before that accounting, the process's peak."""
    memory = summary.get("memory") or {}
    if memory.get("peak") is not None:
        return float(memory["peak"]), "measured peak"
    if memory.get("total") is not None:
        return float(memory["total"]), "accounted total"
    peak = summary.get("peak_memory_mb")
    return (math.nan if peak is None else float(peak)), "process peak"


def _own_figures(g: Group, timing: dict | None) -> dict:
    """Its figures over its seeds; its speed from `timing` where it was timed interleaved."""
    jobs = g.counted
    f = {k: median(j.figures[k] for j in jobs) for k in jobs[0].figures if k not in PAIRED}
    for key in ("final_loss", "eval_loss"):
        f[key], f[f"{key}_std"] = _mean_std(j.figures[key] for j in jobs)
    f |= {"samples_per_s_rounds": None, "speed_source": "jobs"}
    f["memory_source"] = memory_figure(jobs[0].summary)[1]
    if timing is not None:
        f |= {k: timing[k] for k in SPEED} | {"speed_source": "interleaved"}
        # Its MFU by the step time its speed now comes from (as runner/flops.py's utilisation).
        f["mfu"] = f["flops_per_step"] / f["step_time_s"] / (f["peak_tflops"] * 1e12)
    return f | {
        "eval_loss_mean": f["eval_loss"],
        "seeds": len(g.jobs),
        "divergence_rate": len(g.unstable) / len(g.jobs),
        # Against the fp32 job of the same seed: the worst seed's curve gap, a typical final gap.
        "max_loss_gap": max(_finite(j.figures.get("max_loss_gap") for j in jobs), default=math.nan),
        "final_loss_gap": median(j.figures.get("final_loss_gap") for j in jobs),
    }


def _too_small(base: Group) -> tuple[bool | None, str | None]:
    """(too_small_to_tell, the note) for the modes of fp32 group `base`'s setting; None where
    its FLOPs, step time or peak are unknown."""
    b = base.figures
    if not math.isfinite(b["mfu"]):
        return None, None
    if b["mfu"] >= MIN_MATMUL_SHARE:
        return False, None
    return True, (
        f"{base.label}: a step too small to tell the precisions apart by speed — its "
        f"{b['flops_per_step']:.3g} FLOPs would take {b['mfu']:.2%} of its "
        f"{b['step_time_s'] * 1e3:.3g} ms step at the device's fp32 matmul peak "
        f"({b['peak_tflops']:.3g} TFLOP/s), and a precision speeds up only that part (under "
        f"{MIN_MATMUL_SHARE:.0%}, the rest dominates: launches, elementwise ops, the optimizer, "
        "data); time a larger model or batch"
    )


def _gap(g: Group, base: Group) -> tuple[float, str]:
    """(gap_in_spreads, the loss it compares): NaN where either side has under 2 good seeds."""
    both = g.counted + base.counted
    metric = (
        "eval_loss" if all(math.isfinite(j.figures["eval_loss"]) for j in both) else "final_loss"
    )
    ours, theirs = (_finite(j.figures[metric] for j in x.counted) for x in (g, base))
    if min(len(ours), len(theirs)) < 2:
        return math.nan, metric
    n1, n2 = len(ours), len(theirs)
    variance = ((n1 - 1) * statistics.variance(ours) + (n2 - 1) * statistics.variance(theirs)) / (
        n1 + n2 - 2
    )
    m1, m2 = statistics.fmean(ours), statistics.fmean(theirs)
    spread = max(math.sqrt(variance), SPREAD_FLOOR * max(abs(m1), abs(m2)))
    return ((m1 - m2) / spread if spread else 0.0), metric


def _untested(g: Group) -> str:
    few = "one seed" if len(g.jobs) == 1 else "under 2 good seeds here or in fp32"
    return f"{few}: untested against seed noise"


def _problem(g: Group, base: Group | None, tolerance: float) -> str:
    """Why the group cannot be recommended ("" where nothing is wrong); sets its health."""
    f, bad = g.figures, g.unstable
    f["health"] = bad[0].figures["health"] if bad else "ok"
    if bad:
        if len(g.jobs) == 1:
            return bad[0].verdict
        first = bad[0].verdict.split(" — ")[0]
        return (
            f"unstable in {len(bad)} of {len(g.jobs)} seeds ({first}, seed "
            f"{bad[0].config.get('seed', '?')}) — not recommended"
        )
    if base is None or g is base:
        return ""
    gap, metric = f["gap_in_spreads"], f["gap_metric"]
    if math.isfinite(gap) and gap > SEED_NOISE_SPREADS:
        f["health"] = "worse"
        change = f[metric] / base.figures[metric] - 1
        return (
            f"worse than fp32 beyond seed noise: {metric.replace('_', ' ')} {change:+.1%} "
            f"({gap:+.1f} spreads, {f['seeds']} seeds) — not recommended"
        )
    if not math.isfinite(gap) and f["final_loss_gap"] > tolerance:
        f["health"] = "worse"
        return f"loss {f['final_loss_gap']:+.1%} vs fp32 ({_untested(g)}) — not recommended"
    return ""


def _inside_spread(g: Group, base: Group) -> bool | None:
    """Whether its speed and fp32's differ by no more than their interquartile ranges added
    (None where a range is unmeasured: under two timing intervals)."""
    a, b = g.figures, base.figures
    spread = a["samples_per_s_iqr"] + b["samples_per_s_iqr"]
    return abs(a["samples_per_s"] - b["samples_per_s"]) <= spread if math.isfinite(spread) else None


def _loss_words(g: Group) -> str:
    f = g.figures
    gap, metric = f["gap_in_spreads"], f["gap_metric"].replace("_", " ")
    if not math.isfinite(gap):
        return f"loss within {abs(f['final_loss_gap']):.1%} of fp32 ({_untested(g)})"
    where = "below fp32's beyond" if gap < -SEED_NOISE_SPREADS else "within"
    return f"{metric} {where} seed noise of fp32 ({gap:+.1f} spreads, {f['seeds']} seeds)"


def _recommend(fit: list[Group], base: Group) -> None:
    """Verdicts of the groups fit for a recommendation: the fastest measurably faster one whose
    step is large enough to tell wins."""
    inside = {g: _inside_spread(g, base) for g in fit}
    small = {g for g in fit if g is not base and g.figures["too_small_to_tell"]}
    fast = [
        g
        for g in fit
        if g is not base
        and g.figures["speedup"] >= MIN_SPEEDUP
        and not inside[g]
        and g not in small
    ]
    best = max(fast, key=lambda g: g.figures["speedup"], default=base)
    for g in fit:
        if g is base:
            shown = "shown to be faster" if small else "faster"
            g.verdict = "baseline" + (
                f" — recommended: no mode is {shown} here" if best is base else ""
            )
            continue
        x, f = g.figures["speedup"], g.figures
        source = "interleaved timing" if f["speed_source"] == "interleaved" else "per-job timing"
        speed = f"{x:.2f}× {'faster' if x >= 1 else 'the speed'} ({source})"
        if g in small:
            share = base.figures["mfu"]
            tail = f"too small to tell: fp32's FLOPs are {share:.2%} of its step at peak"
        elif inside[g]:
            tail, speed = "no measurable difference", f"{speed} within the speed spread"
        else:
            tail = "recommended" if g is best else ("no gain" if x < MIN_SPEEDUP else "ok")
        g.verdict = f"{speed}, {_loss_words(g)} — {tail}"


def judge(groups: list[Group], tolerance: float, timings: dict | None = None) -> None:
    """Each group's figures (against the fp32 group of its setting) and verdict; `timings`, by
    (precision, setting): the speed of the groups timed interleaved (runner/interleave.py)."""
    timings = timings or {}
    baselines = {
        g.setting: g
        for g in groups
        if g.precision == "fp32" and any(j.summary.get("status") == "completed" for j in g.jobs)
    }
    for g in groups:
        g.figures = _own_figures(g, timings.get((g.precision, g.setting)))
    for g in groups:
        base, f = baselines.get(g.setting), g.figures
        f["too_small_to_tell"], f["note"] = _too_small(base) if base else (None, None)
        if base is not None:
            b = base.figures
            timing = timings.get((g.precision, g.setting))  # fp32's came in the same rounds
            f["speedup"] = timing["speedup"] if timing else f["samples_per_s"] / b["samples_per_s"]
            f["memory_saving"] = 1 - f["memory_mb"] / b["memory_mb"]
            f["gap_in_spreads"], f["gap_metric"] = _gap(g, base)
        else:  # the same keys in every row
            f |= dict.fromkeys(("speedup", "memory_saving", "gap_in_spreads"), math.nan)
            f["gap_metric"] = None
        g.verdict = _problem(g, base, tolerance)
    for setting, base in baselines.items():
        _recommend([g for g in groups if g.setting == setting and not g.verdict], base)
    for g in groups:
        g.verdict = g.verdict or "no fp32 run to compare with"
