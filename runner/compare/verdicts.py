"""A sweep's jobs grouped by everything but the seed, and each group's verdict against its
baseline (the fp32 row of its setting; runner/compare/sweep.py chooses it).

Per group (a precision in one setting): its figures over seeds (the losses' mean ± std, a typical
seed's median for the rest), its divergence rate (the share of seeds that failed, diverged or
overflowed), and its loss against the baseline's, on the eval loss where every good seed of both
has one, else the final training loss:

- with 2+ seeds that both rows ran, the geometric mean of the per-seed loss ratios less 1
  (`loss_gap`) and its interval, paired: Student's t on the log ratios (a seed's own luck
  cancels); where the seeds do not pair, Welch's t on the log losses over 2+ good seeds a side.
  The words follow the interval and each seed's own gap against the tolerance (loss_gap.py's
  loss_class): worse beyond it (the interval, or any one seed), equivalent where the interval
  and every seed lie within it, untested where the interval holds it (more seeds would tell).
  `gap_in_spreads` is the gap in units of the pooled seed-to-seed spread (at least
  SPREAD_FLOOR of the loss).
- with one seed, the relative gap of the eval loss where both have one, else of the smoothed
  final training loss; untested against seed noise, and worse beyond the tolerance.
A gap that cannot be computed (no curve, no eval) is untested and never recommended.

A speed is measurably different from the baseline's only where the two differ by more than their
interquartile ranges added; inside that, a mode is never recommended, and a speed whose spread
was not measured (under two steady logging intervals) is untested, never "faster". The speed
comes from each job's own steady window (speed_source "jobs"), or, with runner.speed=interleaved,
from the rows timed again side by side in one process (runner/compare/interleave.py; "interleaved":
medians and IQR over rounds, the speedup the per-round ratios to the baseline averaged as
runner/compare/stats.py's round_ratio averages them, each order of the rounds weighted alike).

A speed timed while another process held the run's cores (`speed_contended`, in a job's
summary.json or in the interleaved rounds: runner/measure/contention.py) is untested, its row
named with what it got and how to time it cleanly; where the baseline's was, every row's is.

A step too small to show a precision effect is never recommended on its speed either. A
precision speeds up the matmuls and convolutions only, so the share of the baseline's step they
take bounds what any mode can gain (Amdahl); where its audited FLOPs would take under
MIN_MATMUL_SHARE of its measured step time at the device's matmul peak (its MFU), most of the
step is something no precision speeds up, and every mode of that setting is too small to tell.
"""

from __future__ import annotations

import math
import re

from runner.compare import capacity, projected, target
from runner.compare.groups import Group, own_figures
from runner.compare.loss_gap import (
    LOSS_GAP,
    SEED_GAPS,
    _gap,
    _loss_words,
    _name,
    _problem,
    gaps_to_bf16,
)
from runner.compare.stats import CONFIDENCE, round_ratio
from runner.compare.target_words import (
    _target_problem,
    _target_untested,
    _to_target,
    missed,
    speed_class,
)
from runner.train.speed import HOW_TO_TIME, QUIETLY

MIN_SPEEDUP = 1.05  # below this, a mode is not worth its risk over fp32
# The least share of the baseline's step its FLOPs take at the device's matmul peak
# (flops_per_step over step_time_s, over peak_tflops: its MFU) for a speed to tell anything about
# precision. Small matmuls reach a tenth of the peak or so; under 5% at the peak, then, the
# matmuls and convolutions take under half the step even so, and the rest (kernel launches,
# Python, elementwise ops, the optimizer, data) runs the same in every precision.
MIN_MATMUL_SHARE = 0.05


def _too_small(base: Group) -> tuple[bool | None, str | None]:
    """(too_small_to_tell, the note) for the modes of baseline `base`'s setting; None where
    its FLOPs, step time or peak are unknown."""
    b = base.figures
    if not math.isfinite(b["mfu"]):
        return None, None
    if b["mfu"] >= MIN_MATMUL_SHARE:
        return False, None
    return True, (
        f"{base.label}: a step too small to tell the precisions apart by speed — its "
        f"{b['flops_per_step']:.3g} FLOPs would take {b['mfu']:.2%} of its "
        f"{b['step_time_s'] * 1e3:.3g} ms step at the device's {base.precision} matmul peak "
        f"({b['peak_tflops']:.3g} TFLOP/s), and a precision speeds up only that part (under "
        f"{MIN_MATMUL_SHARE:.0%}, the rest dominates: launches, elementwise ops, the optimizer, "
        "data); time a larger model or batch"
    )


def _inside_spread(g: Group, base: Group) -> bool | None:
    """Whether its speed and the baseline's differ by no more than their interquartile ranges
    added (None where a range is unmeasured: under two steady timing intervals)."""
    a, b = g.figures, base.figures
    spread = a["samples_per_s_iqr"] + b["samples_per_s_iqr"]
    return abs(a["samples_per_s"] - b["samples_per_s"]) <= spread if math.isfinite(spread) else None


def _recommend(fit: list[Group], base: Group, tolerance: float, unfit: list[Group]) -> None:
    """Verdicts of the groups fit for a recommendation, ranked by time to target: of the
    measurably faster ones whose step is large enough to tell, the fastest to the target wins,
    at least MIN_SPEEDUP there (and, over seeds, its interval clear of 1); a speed whose spread
    is unmeasured, or a time to target that cannot be told, is untested. `unfit`: the rows
    its verdicts already refuse (a loss worse or untested, ...): the faster of them named."""
    inside = {g: _inside_spread(g, base) for g in fit}
    small = {g for g in fit if g is not base and g.figures["too_small_to_tell"]}
    emulated = {g for g in fit if g is not base and g.figures["speed_emulated"]}
    untimed = {g for g in fit if g is not base and inside[g] is None} - emulated
    shared = base.figures["speed_contended"]  # the baseline's: every ratio to it is untested
    contended = {
        g for g in fit if g is not base and (shared or g.figures["speed_contended"])
    } - emulated
    untested = {g: _target_untested(g) for g in fit if g is not base}
    fast = [
        g
        for g in fit
        if g is not base
        and g.figures["speedup"] >= MIN_SPEEDUP
        and inside[g] is False
        and not {g} & (small | emulated | contended)
    ]
    to_target = [
        g
        for g in fast
        if untested[g] is None
        and g.figures["time_to_target_speedup"] >= MIN_SPEEDUP
        and speed_class(g.figures) == "faster"
    ]
    best = max(to_target, key=lambda g: g.figures["time_to_target_speedup"], default=base)
    for g in fit:
        if g is base:
            if base.figures["target_status"] == "not reached":
                g.verdict = f"baseline — {missed(base)}" + (
                    "" if best is not base else "; no mode is recommended"
                )
                continue
            unknown = small or untimed or emulated or contended or any(untested.values())
            shown = "shown to be faster" if unknown else "faster"
            fast = [x.label for x in unfit if x.figures["speedup"] >= MIN_SPEEDUP]
            but = f" but {', '.join(fast)}, not recommended" if fast else ""
            g.verdict = "baseline" + (
                f" — recommended: no mode is {shown} here{but}" if best is base else ""
            )
            continue
        x, f = g.figures["speedup"], g.figures
        source = "interleaved timing" if f["speed_source"] == "interleaved" else "per-job timing"
        speed = (
            f"{x:.2f}× {'faster' if x >= 1 and g not in contended else 'the speed'} ({source})"
            if math.isfinite(x)
            else f"speed unmeasured ({source})"
        )
        f = g.figures
        measured = untested[g] is None
        head = (
            _to_target(g, speed, source, bool({g} & (emulated | small | untimed | contended)))
            if measured
            else speed
        )
        if g in emulated:
            how = {
                "converted": f"its {g.precision} matmuls were emulated (quantized and dequantized "
                "in PyTorch, no kernels of that format here)",
                "nothing converted": f"its {g.precision} converted no Linear, so it ran as bf16",
            }.get(
                f["speed_emulated_by"],
                f"its {g.precision} matmuls ran in fp32 on this CPU (precision.cpu_kernels)",
            )
            tail = f"speed emulated: {how}, so it tells nothing of its own speed"
        elif g in contended:
            who = base if shared else g
            how = QUIETLY if who.figures["speed_source"] == "interleaved" else HOW_TO_TIME
            tail = (
                f"speed untested: {_name(who)} ran contended ({who.figures['contention']}); "
                f"for a clean figure, {how}"
            )
        elif g in small:
            share = base.figures["mfu"]
            tail = f"too small to tell: {_name(base)}'s FLOPs are {share:.2%} of its step at peak"
        elif g in untimed:
            tail = "speed untested: its spread was not measured (under two steady timing intervals)"
        elif inside[g]:
            tail = "no measurable difference"
            head = head.replace(speed, f"{speed} within the speed spread", 1)
        elif not measured:
            tail = untested[g]
        elif speed_class(f) == "slower":
            tail = "slower to the target"
        elif speed_class(f) == "untested":
            f["undecided"] = "time to target"  # more seeds would tell (runner/compare/seeds.py)
            tail = "time to target untested: its interval holds 1, more seeds would tell"
        elif g is best:
            tail = "recommended"
        elif g in to_target:
            tail = f"faster to the target, second to {best.label}"
        else:
            tail = "no gain" if min(x, f["time_to_target_speedup"]) < MIN_SPEEDUP else "ok"
        g.verdict = f"{head}, {_loss_words(g, tolerance)} — {tail}"


def judge(
    groups: list[Group],
    tolerance: float,
    timings: dict | None = None,
    spec: target.TargetSpec | None = None,
    level: float = CONFIDENCE,
    first: frozenset | None = None,
) -> None:
    """Each group's figures (against its baseline, `g.base`) and verdict; `timings`, by the
    row's key: the speed of the rows timed interleaved (runner/compare/interleave.py); `spec`:
    the target each row is timed to (runner/compare/target.py; default: the baseline's final
    eval loss within `tolerance`); `level`: the confidence of every interval; `first`: a
    runner.seeds=auto sweep's first look's seeds, which the default target and each row's
    own speed come from (runner/compare/seeds.py)."""
    timings = timings or {}
    for g in groups:
        figures = own_figures(g, timings.get(g.key), first)
        g.figures = figures | {"confidence": level, "undecided": None}
    target.measure(groups, spec or target.TargetSpec(), tolerance, first)
    for g in groups:
        base, f = g.base, g.figures
        f["too_small_to_tell"], f["note"] = _too_small(base) if base else (None, None)
        f["baseline"] = base.label if base else None
        if base is not None:
            b = base.figures
            ours, theirs = timings.get(g.key), timings.get(base.key)  # timed in the same rounds
            f["speedup"] = (
                round_ratio(ours["samples_per_s_rounds"], theirs["samples_per_s_rounds"])
                if ours and theirs
                else f["samples_per_s"] / b["samples_per_s"]
            )
            f["memory_saving"] = 1 - f["memory_mb"] / b["memory_mb"]
            f["max_batch_vs_fp32"] = capacity.against(g, base)
            f |= _gap(g, base)
        else:  # the same keys in every row
            f |= dict.fromkeys(("speedup", "memory_saving", "gap_in_spreads"), math.nan)
            f["max_batch_vs_fp32"] = math.nan
            f |= dict.fromkeys(LOSS_GAP + SEED_GAPS, math.nan)
            f["gap_metric"] = f["gap_fallback"] = None
        g.verdict = _problem(g, tolerance) or _target_problem(g)
    gaps_to_bf16(groups)  # a figure beside the verdicts, which stay against fp32
    target.pair(groups)  # against the baselines' step speedups, set just above
    for base in {g.base for g in groups if g.base is not None}:
        rows = [g for g in groups if g.base is base]
        unfit = [g for g in rows if g.verdict and g is not base]
        _recommend([g for g in rows if not g.verdict], base, tolerance, unfit)
        if base.precision != "fp32":
            note = f"no fp32 run in this setting: its rows are compared with {base.label}"
            for g in groups:
                if g.base is base:
                    g.figures["note"] = "; ".join(filter(None, [g.figures["note"], note]))
    for g in groups:
        g.verdict = g.verdict or "no fp32 run to compare with"
        f = g.figures
        f["target_note"] = None
        if math.isfinite(f["target"]) and g.base is not None:
            sources = {x.figures["time_source"] for x in groups if x.base is g.base} - {None}
            how = {
                "interleaved": "the interleaved timing's step time",
                "jobs": "each job's own median step time",
                "clock": "the run's own clock",
            }
            by = "; ".join(how.get(s, s) for s in sorted(sources)) or "no step time"
            note = (
                f"target: {target.TargetSpec(metric=f['target_metric'], direction=f['target_direction']).words()} "
                f"{f['target']:.4f} ({f['target_from']}); time to target = steps to it (where a "
                f"quadratic fitted to the evaluations around it crosses the target) × {by}"
            )
            f["target_note"] = note  # under the table, after the setting's own note
    projected.fill(groups)  # runner.project's estimates, after the verdicts: they recommend none


def in_short(verdict: str) -> str:
    """A verdict in a few words, for the printed table (compare.md and the lines below the table
    have it whole): what went wrong where it names a problem ("diverged: ...", "failed: ...", or
    whatever precedes " — not recommended"), else its outcome after " — " ("recommended",
    "speed emulated", ...); "baseline" first where it is one."""
    head, sep, tail = verdict.partition(" — ")
    first = re.split(r":| \(", head, maxsplit=1)[0]
    if head.startswith("baseline"):
        return "baseline" + (", recommended" if tail.startswith("recommended") else "")
    if not sep or tail.startswith("not recommended") or head[len(first) : len(first) + 1] == ":":
        return first
    return tail.split(":")[0]
