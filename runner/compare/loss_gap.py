"""The loss half of a verdict (runner/compare/verdicts.py): a row's loss against its
baseline's (Welch's interval over 2+ good seeds a side, else one seed's relative gap), why a row
cannot be recommended (unstable seeds, a plan that did not hold, a loss worse beyond the
tolerance), and the loss in words."""

from __future__ import annotations

import math
import statistics

from runner.compare.groups import Group, closest, completed
from runner.compare.stats import finite, welch

SPREAD_FLOOR = 1e-6  # the least spread, relative to the loss
LOSS_GAP = ("loss_gap", "loss_gap_ci_low", "loss_gap_ci_high")  # against the row's baseline
BF16_GAP = ("loss_gap_bf16", "loss_gap_bf16_ci_low", "loss_gap_bf16_ci_high")


def _name(base: Group) -> str:
    """How a verdict names its baseline: fp32, or the row it is compared with instead."""
    return "fp32" if base.precision == "fp32" else base.label


def _gap(g: Group, base: Group) -> dict:
    """The loss comparison's figures: the metric compared (eval loss where every good seed of
    both has one), gap_in_spreads and the Welch interval (NaN under 2 good seeds a side), and
    for one seed the plain relative gap of that metric."""
    both = g.counted + base.counted
    metric = (
        "eval_loss" if all(math.isfinite(j.figures["eval_loss"]) for j in both) else "final_loss"
    )
    ours, theirs = (finite(j.figures[metric] for j in x.counted) for x in (g, base))
    out = {"gap_metric": metric, "gap_in_spreads": math.nan}
    out |= dict.fromkeys(LOSS_GAP, math.nan)
    if min(len(ours), len(theirs)) >= 2:
        n1, n2 = len(ours), len(theirs)
        variance = (
            (n1 - 1) * statistics.variance(ours) + (n2 - 1) * statistics.variance(theirs)
        ) / (n1 + n2 - 2)
        m1, m2 = statistics.fmean(ours), statistics.fmean(theirs)
        spread = max(math.sqrt(variance), SPREAD_FLOOR * max(abs(m1), abs(m2)))
        out["gap_in_spreads"] = (m1 - m2) / spread if spread else 0.0
        out["loss_gap"], out["loss_gap_ci_low"], out["loss_gap_ci_high"] = welch(ours, theirs)
    elif metric == "eval_loss" and ours and theirs and statistics.fmean(theirs):
        m1, m2 = statistics.fmean(ours), statistics.fmean(theirs)
        out["loss_gap"] = (m1 - m2) / abs(m2)  # one seed: its eval loss decides
    else:
        out["loss_gap"] = g.figures["final_loss_gap"]  # the smoothed training loss
    return out


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
    return f"95% CI {f['loss_gap_ci_low']:+.2%} to {f['loss_gap_ci_high']:+.2%}, {f['seeds']} seeds"


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
    if not math.isfinite(gap):
        return f"{metric} untested: no loss to compare with {name}'s — not recommended"
    if math.isfinite(f["loss_gap_ci_low"]):  # 2+ seeds a side
        if f["loss_gap_ci_low"] > 0 and gap > tolerance:
            f["health"] = "worse"
            return (
                f"worse than {name} beyond seed noise: {metric} {gap:+.2%} ({_ci(f)}) — "
                "not recommended"
            )
        if f["loss_gap_ci_low"] <= 0 and gap > tolerance:
            return (
                f"{metric} {gap:+.2%} vs {name}, inside seed noise ({_ci(f)}): untested — "
                "more seeds would tell"
            )
        return ""
    if gap > tolerance:
        f["health"] = "worse"
        return f"{metric} {gap:+.2%} vs {name} ({_untested(g)}) — not recommended"
    return ""


def _untested(g: Group) -> str:
    few = "one seed" if len(g.jobs) == 1 else "under 2 good seeds here or in the baseline"
    return f"{few}: untested against seed noise"


def _loss_words(g: Group, tolerance: float) -> str:
    f, name = g.figures, _name(g.base)
    gap, metric = f["loss_gap"], f["gap_metric"].replace("_", " ")
    if not math.isfinite(f["loss_gap_ci_low"]):
        return f"{metric} within {abs(gap):.2%} of {name} ({_untested(g)})"
    if f["loss_gap_ci_high"] < 0:
        return f"{metric} below {name}'s beyond seed noise ({gap:+.2%}, {_ci(f)})"
    if f["loss_gap_ci_low"] > 0:
        return (
            f"{metric} {gap:+.2%} vs {name}, beyond seed noise but within the "
            f"{tolerance:.0%} tolerance ({_ci(f)})"
        )
    return f"{metric} within seed noise of {name} ({gap:+.2%}, {_ci(f)})"
