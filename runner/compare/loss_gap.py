"""The loss half of a verdict (runner/compare/verdicts.py): a row's loss against its
baseline's (a paired interval over the seeds both ran, else Welch's over 2+ good seeds a side,
else one seed's relative gap), what that interval says against the tolerance (`loss_class`), why
a row cannot be recommended (unstable seeds, a plan that did not hold, a loss worse beyond the
tolerance or not shown to be within it), and the loss in words."""

from __future__ import annotations

import math
import statistics

from runner.compare.groups import Group, closest, completed
from runner.compare.stats import CONFIDENCE, paired, percent, welch

SPREAD_FLOOR = 1e-6  # the least spread, relative to the loss
LOSS_GAP = ("loss_gap", "loss_gap_ci_low", "loss_gap_ci_high")  # against the row's baseline
BF16_GAP = ("loss_gap_bf16", "loss_gap_bf16_ci_low", "loss_gap_bf16_ci_high")


def _name(base: Group) -> str:
    """How a verdict names its baseline: fp32, or the row it is compared with instead."""
    return "fp32" if base.precision == "fp32" else base.label


def _by_seed(g: Group, metric: str) -> dict:
    """Its counted seeds' values of `metric`, by seed (those with a finite value)."""
    values = {j.config.get("seed"): j.figures[metric] for j in g.counted}
    return {k: v for k, v in values.items() if math.isfinite(v)}


def _gap(g: Group, base: Group) -> dict:
    """The loss comparison's figures: the metric compared (eval loss where every good seed of
    both has one), gap_in_spreads, the interval (`loss_gap_test`: paired over the 2+ seeds both
    ran, else Welch's over 2+ a side; NaN below that), and for one seed the plain relative gap."""
    both = g.counted + base.counted
    metric = (
        "eval_loss" if all(math.isfinite(j.figures["eval_loss"]) for j in both) else "final_loss"
    )
    level = g.figures.get("confidence", CONFIDENCE)
    mine, theirs = _by_seed(g, metric), _by_seed(base, metric)
    ours, others = list(mine.values()), list(theirs.values())
    out = {"gap_metric": metric, "gap_in_spreads": math.nan}
    out |= {"loss_gap_test": None, "loss_gap_seeds": None}
    out |= dict.fromkeys(LOSS_GAP, math.nan)
    common = [s for s in mine if s in theirs and s is not None]
    if min(len(ours), len(others)) >= 2:
        n1, n2 = len(ours), len(others)
        variance = (
            (n1 - 1) * statistics.variance(ours) + (n2 - 1) * statistics.variance(others)
        ) / (n1 + n2 - 2)
        m1, m2 = statistics.fmean(ours), statistics.fmean(others)
        spread = max(math.sqrt(variance), SPREAD_FLOOR * max(abs(m1), abs(m2)))
        out["gap_in_spreads"] = (m1 - m2) / spread if spread else 0.0
    if len(common) >= 2:
        pairs = [mine[s] for s in common], [theirs[s] for s in common]
        out |= dict(zip(LOSS_GAP, paired(*pairs, level), strict=True))
        out["loss_gap_test"], out["loss_gap_seeds"] = "paired", len(common)
    elif min(len(ours), len(others)) >= 2:
        out |= dict(zip(LOSS_GAP, welch(ours, others, level), strict=True))
        out["loss_gap_test"], out["loss_gap_seeds"] = "welch", f"{len(ours)} and {len(others)}"
    elif metric == "eval_loss" and ours and others and statistics.fmean(others):
        m1, m2 = statistics.fmean(ours), statistics.fmean(others)
        out["loss_gap"] = (m1 - m2) / abs(m2)  # one seed: its eval loss decides
    else:
        out["loss_gap"] = g.figures["final_loss_gap"]  # the smoothed training loss
    return out


def loss_class(f: dict, tolerance: float) -> str:
    """What the loss gap's interval says against the tolerance τ: "worse" (it lies beyond +τ),
    "equivalent" (both ends within ±τ), "lower" (below 0 and reaching past −τ), "untested"
    (it holds +τ: more seeds would tell); with one seed, no interval: "one seed" (the gap's
    own size decides), "no loss" where there is nothing to compare."""
    gap, low, high = (f[k] for k in LOSS_GAP)
    if not math.isfinite(gap):
        return "no loss"
    if not math.isfinite(low):
        return "one seed"
    if low > tolerance:
        return "worse"
    if high <= tolerance:
        return "equivalent" if low >= -tolerance else "lower"
    return "untested"


def gaps_to_bf16(groups: list[Group]) -> None:
    """Where a setting has an fp32 baseline and a bf16 row, each of its other low-precision rows'
    loss gap to bf16 too (fp8's and fp4's rival: whether they lose what bf16 keeps), as
    `loss_gap_bf16` with its interval; NaN elsewhere. A figure beside the verdict, which stays
    against fp32."""
    for g in groups:
        g.figures |= dict.fromkeys(BF16_GAP, math.nan)
        if g.base is None or g.base.precision != "fp32" or g.precision in ("fp32", "bf16"):
            continue
        rivals = [
            p for p in groups if p.setting == g.setting and p.precision == "bf16" and completed(p)
        ]
        if not rivals:
            continue
        gap = _gap(g, closest(g, rivals))
        if gap["gap_metric"] == "final_loss" and not math.isfinite(gap["loss_gap_ci_low"]):
            continue  # one seed without evaluations: _gap's fallback is the gap to fp32
        g.figures |= dict(zip(BF16_GAP, (gap[k] for k in LOSS_GAP), strict=True))


def _ci(f: dict) -> str:
    """The loss gap's interval in words: its level, its ends, the test and its seeds."""
    n = f["loss_gap_seeds"]
    test = f"paired over {n} seeds" if f["loss_gap_test"] == "paired" else f"Welch, {n} seeds"
    return (
        f"{percent(f['confidence'])} CI {f['loss_gap_ci_low']:+.2%} to "
        f"{f['loss_gap_ci_high']:+.2%}, {test}"
    )


def _problem(g: Group, tolerance: float) -> str:
    """Why the group cannot be recommended ("" where nothing is wrong); sets its health."""
    f, bad, base = g.figures, g.unstable, g.base
    f["health"] = bad[0].figures["health"] if bad else "ok"
    if bad:
        if len(g.jobs) == 1:
            return bad[0].verdict
        first = bad[0].verdict.split(" — ")[0]
        return (
            f"unstable in {len(bad)} of {len(g.jobs)} seeds ({first}, seed "
            f"{bad[0].config.get('seed', '?')}) — not recommended"
        )
    if f["plan_held"] is False:  # it did not run the precision its row names
        mismatch = f["plan_mismatch"]
        return "the precision plan did not hold" + (f": {mismatch}" if mismatch else "")
    if base is None or g is base:
        return ""
    gap, metric, name = f["loss_gap"], f["gap_metric"].replace("_", " "), _name(base)
    kind = loss_class(f, tolerance)
    if kind == "no loss":
        return f"{metric} untested: no loss to compare with {name}'s — not recommended"
    if kind == "worse":
        f["health"] = "worse"
        return (
            f"worse than {name}: {metric} {gap:+.2%}, its interval beyond the {percent(tolerance)} "
            f"tolerance ({_ci(f)}) — not recommended"
        )
    if kind == "untested":
        f["undecided"] = "loss gap"  # more seeds would tell (runner/compare/seeds.py)
        return (
            f"{metric} {gap:+.2%} vs {name}, its interval reaching past the {percent(tolerance)} "
            f"tolerance ({_ci(f)}): untested — more seeds would tell"
        )
    if kind == "one seed" and gap > tolerance:
        f["health"] = "worse"
        return f"{metric} {gap:+.2%} vs {name} ({_untested(g)}) — not recommended"
    return ""


def _untested(g: Group) -> str:
    few = "one seed" if len(g.jobs) == 1 else "under 2 good seeds here or in the baseline"
    return f"{few}: untested against seed noise"


def _loss_words(g: Group, tolerance: float) -> str:
    """The loss of a row fit for a recommendation, in the words its interval decides."""
    f, name = g.figures, _name(g.base)
    gap, metric = f["loss_gap"], f["gap_metric"].replace("_", " ")
    kind = loss_class(f, tolerance)
    if kind == "one seed":
        return f"{metric} within {abs(gap):.2%} of {name} ({_untested(g)})"
    if kind == "lower":
        return f"{metric} below {name}'s, no worse beyond the tolerance ({gap:+.2%}, {_ci(f)})"
    return (
        f"{metric} equivalent to {name}'s within the ±{percent(tolerance)} tolerance "
        f"({gap:+.2%}, {_ci(f)})"
    )
