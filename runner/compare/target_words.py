"""The time-to-target half of a verdict (runner/compare/verdicts.py; the figures are
runner/compare/target.py's): why a row that never reached the target is not recommended, why
its time to target cannot be told, and the verdict's head that puts the step speed and the time
to the target in words."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from runner.compare import crossing, target
from runner.compare.loss_gap import _name
from runner.compare.stats import percent

if TYPE_CHECKING:
    from runner.compare.groups import Group


def _target_problem(g: Group) -> str:
    """Why a row that never reached the target cannot be recommended ("" where it did, or where
    there is nothing to reach): however fast its steps, it never gets there. Its seeds whose
    baseline twin missed the target too do not count: that target is the baseline's problem
    (`_target_untested` names the twin)."""
    f = g.figures
    if g.base is None or g is g.base or f["target_status"] != "not reached":
        return ""
    if not set(f["target_missed_seeds"]) - set(g.base.figures["target_missed_seeds"]):
        return ""
    gap = (f["target_closest"] - f["target"]) / abs(f["target"] or 1.0)
    metric = f["target_metric"].replace("_", " ")
    seeds = f" ({f['target_seeds_reached']} of {len(g.counted)} seeds reached it)"
    return (
        f"target not reached: its best smoothed {metric} {f['target_closest']:.4g} stayed "
        f"{abs(gap):.2%} short of {f['target']:.4g}"
        + (seeds if len(g.counted) > 1 else "")
        + " — not recommended"
    )


def _target_untested(g: Group) -> str | None:
    """Why the time to target of a row fit for a recommendation cannot be told (None where it
    can): no target or no eval curve, a baseline seed it pairs with that never reached it, or
    evaluations too sparse to time the crossing, with the trainer.val_check_interval that
    would. Of the baseline, only its seeds the row ran count (an auto sweep's later seeds, run
    for other rows, cannot reopen this one)."""
    f = g.figures
    metric = f["target_metric"]
    if f["target_status"] == "no target":
        return f"time to target untested: {f['target_from']}"
    seeds = {j.config.get("seed") for j in g.counted}
    twins = [j for j in g.base.counted if j.config.get("seed") in seeds]
    status = {
        x: [j for j in jobs if getattr(j, "reach", None)]
        for x, jobs in ((g.base, twins), (g, g.counted))
    }
    if f["target_status"] == "no curve" or any(
        j.reach["status"] == "no curve" for j in status[g.base]
    ):
        return (
            f"time to target untested: no {metric} evaluated during training "
            "(trainer.val_check_interval)"
        )
    if set(g.base.figures["target_missed_seeds"]) & seeds:  # a baseline seed it pairs with
        return f"time to target untested: {missed(g.base, seeds)}"
    sparse = [
        (x, j) for x, jobs in status.items() for j in jobs if j.reach["status"] == "too sparse"
    ]
    if sparse:
        x, job = sparse[0]
        return (
            f"time to target untested: evaluations too sparse to time it "
            f"({job.reach['evals_before']} before the target in {x.label}, seed "
            f"{job.config.get('seed')}; at least {crossing.MIN_EVALS} needed): set "
            f"trainer.val_check_interval={target.interval_for(g)} or less"
        )
    if not math.isfinite(f["time_to_target_speedup"]):
        if not twins:  # a ratio is per seed, against its twin
            return (
                f"time to target untested: none of its seeds ran in {_name(g.base)} too, and "
                "its ratio is taken seed by seed: run the baseline's seeds"
            )
        return "time to target untested: no step time to take it by"
    return None


def missed(base: Group, among: set | None = None) -> str:
    """The baseline's seeds that never reached the target (of those `among`, where given),
    named, with the closest they came."""
    f = base.figures
    seeds = [s for s in f["target_missed_seeds"] if among is None or s in among]
    which = ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(str(s) for s in seeds)
    return (
        f"{_name(base)} {which} never reached the target {f['target']:.4g} (best "
        f"{f['target_closest']:.4g}): set compare.target no further than that"
    )


def _ci_of(f: dict, key: str) -> str:
    low, high = f[f"{key}_ci_low"], f[f"{key}_ci_high"]
    level, n = percent(f["confidence"]), f[f"{key}_pairs"]
    if not math.isfinite(low):  # one pair: no interval, whatever the row's seeds
        paired = f"{n} of its {f['seeds']} seeds paired with the baseline's"
        return "one seed" if f["seeds"] == 1 else f"{paired}: untested against seed noise"
    return f"{level} CI {low:.2f}× to {high:.2f}×, {n} seeds paired, assuming normal log ratios"


def speed_class(f: dict) -> str:
    """What the time-to-target speedup's interval says: "faster" (it lies above 1), "slower"
    (below 1), "untested" (it holds 1); with one seed, no interval: the estimate's side of 1."""
    t, low, high = (f[k] for k in ("time_to_target_speedup", *_ends("time_to_target_speedup")))
    if not math.isfinite(low):
        return "faster" if t >= 1 else "slower"
    return "faster" if low > 1 else "slower" if high < 1 else "untested"


def _ends(key: str) -> tuple[str, str]:
    return f"{key}_ci_low", f"{key}_ci_high"


def _to_target(g: Group, speed: str, source: str, per_step_only: bool) -> str:
    """The verdict's head: the step speed and the time to target, both in words that follow
    the time-to-target interval ("faster", "slower", "within seed noise of" where it holds 1)."""
    f = g.figures
    x, t, r = f["speedup"], f["time_to_target_speedup"], f["steps_to_target_ratio"]
    if per_step_only:  # its own speed tells nothing: the steps it needs still do
        return f"{speed}, {r:.2f}× the steps to the target ({_ci_of(f, 'steps_to_target_ratio')})"
    kind, ci = speed_class(f), _ci_of(f, "time_to_target_speedup")
    if x >= 1 and kind == "slower":  # faster per step, slower to the target: both, in words
        return (
            f"{x:.2f}× the step speed, {t:.2f}× to the target: it needs {r:.2f}× the "
            f"steps ({source}; {ci})"
        )
    words = {
        "faster": f"{t:.2f}× faster to the target",
        "slower": f"{t:.2f}× the speed to the target: slower",
        "untested": f"{t:.2f}× to the target, within seed noise",
    }[kind]
    return f"{speed}, {words} ({r:.2f}× the steps; {ci})"
