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
    there is nothing to reach): however fast its steps, it never gets there."""
    f = g.figures
    if g.base is None or g is g.base or f["target_status"] != "not reached":
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
    can): no target or no eval curve, a baseline that never reached it, or evaluations too
    sparse to time the crossing, with the trainer.val_check_interval that would."""
    f, b = g.figures, g.base.figures
    metric = f["target_metric"]
    if f["target_status"] == "no target":
        return f"time to target untested: {f['target_from']}"
    if "no curve" in (f["target_status"], b["target_status"]):
        return (
            f"time to target untested: no {metric} evaluated during training "
            "(trainer.val_check_interval)"
        )
    if b["target_status"] == "not reached":
        return f"time to target untested: {missed(g.base)}"
    sparse = [x for x in (g.base, g) if x.figures["target_status"] == "too sparse"]
    if sparse:
        x = sparse[0]
        n = x.figures["evals_before_target"]
        return (
            f"time to target untested: evaluations too sparse to time it ({n} before the target "
            f"in {x.label}, seed {x.figures['target_sparse_seed']}; at least "
            f"{crossing.MIN_EVALS} needed): set trainer.val_check_interval="
            f"{target.interval_for(g)} or less"
        )
    if not math.isfinite(f["time_to_target_speedup"]):
        return "time to target untested: no step time to take it by"
    return None


def missed(base: Group) -> str:
    """The baseline's seeds that never reached the target, named, with the closest they came."""
    f = base.figures
    seeds = ", ".join(str(s) for s in f["target_missed_seeds"])
    which = f"seed {seeds}" if len(f["target_missed_seeds"]) == 1 else f"seeds {seeds}"
    return (
        f"{_name(base)} {which} never reached the target {f['target']:.4g} (best "
        f"{f['target_closest']:.4g}): set compare.target no further than that"
    )


def _ci_of(f: dict, key: str) -> str:
    low, high = f[f"{key}_ci_low"], f[f"{key}_ci_high"]
    if not math.isfinite(low):
        return "one seed" if f["seeds"] == 1 else "no interval"
    level, n = percent(f["confidence"]), f["target_seeds_reached"]
    return f"{level} CI {low:.2f}× to {high:.2f}×, {n} seeds paired"


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
