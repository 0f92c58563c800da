"""The loss half of a verdict (runner/compare/verdicts.py): a row's loss against its
baseline's on per-seed loss ratios (a paired t interval on their logarithms over the seeds both
ran, else Welch's on the log losses over 2+ good seeds a side, else one seed's relative gap),
each seed's own gap (the worst shown: a seed beyond the tolerance is never recommended, however
good the mean), what the interval and the seeds say against the tolerance (`loss_class`), why a
row cannot be recommended (unstable seeds, or an unstable baseline, a plan that did not hold, a
loss worse beyond the tolerance or not shown to be within it), and the loss in words, with what
its clean seeds cannot exclude."""

from __future__ import annotations

import math
import statistics

from runner.compare.groups import Group, closest, completed
from runner.compare.stats import (
    CONFIDENCE,
    clean_bound,
    paired,
    percent,
    seeds_to_rule_out,
    welch,
)

SPREAD_FLOOR = 1e-6  # the least spread, relative to the loss
RULE_OUT = 0.10  # the per-seed failure rate a clean verdict says how many seeds would rule out
LOSS_GAP = ("loss_gap", "loss_gap_ci_low", "loss_gap_ci_high")  # against the row's baseline
# each seed's own gap: the worst (highest), the best, the seed that is worst, how many seeds,
# and whether the worst is against its twin (else against the range of the baseline's seeds)
SEED_GAPS = (
    "loss_gap_worst_seed",
    "loss_gap_best_seed",
    "loss_gap_worst_seed_is",
    "loss_gap_own_seeds",
    "loss_gap_worst_seed_twin",
)
BF16_GAP = ("loss_gap_bf16", "loss_gap_bf16_ci_low", "loss_gap_bf16_ci_high")


def _name(base: Group) -> str:
    """How a verdict names its baseline: fp32, or the row it is compared with instead."""
    return "fp32" if base.precision == "fp32" else base.label


def _by_seed(g: Group, metric: str) -> dict:
    """Its counted seeds' values of `metric`, by seed (those with a finite value)."""
    values = {j.config.get("seed"): j.figures[metric] for j in g.counted}
    return {k: v for k, v in values.items() if math.isfinite(v)}


def _metric(g: Group, base: Group) -> tuple[str, str | None]:
    """The loss compared, and why it is not the eval loss (None where it is): the eval loss
    where every good seed of both rows has one, else the final training loss, named."""
    lacking = [
        (x, j) for x in (base, g) for j in x.counted if not math.isfinite(j.figures["eval_loss"])
    ]
    if not lacking:
        return "eval_loss", None
    x, j = lacking[0]
    return "final_loss", f"no eval loss in {x.label} seed {j.config.get('seed', '?')}"


def _gap(g: Group, base: Group) -> dict:
    """The loss comparison's figures: the metric compared (`gap_metric`; `gap_fallback` says
    why where it is not the eval loss), gap_in_spreads, the interval (`loss_gap_test`: paired
    over the 2+ seeds both ran, else Welch's over 2+ a side; NaN below that, or where a loss is
    not positive: no ratio), each seed's own gap (SEED_GAPS: against its twin, the baseline's
    job of the same seed; a seed without one, paired interval or not, against the range of the
    baseline's seeds, 0 inside it: every seed of the row is judged), and for one seed the plain
    relative gap."""
    metric, fallback = _metric(g, base)
    level = g.figures.get("confidence", CONFIDENCE)
    mine, theirs = _by_seed(g, metric), _by_seed(base, metric)
    ours, others = list(mine.values()), list(theirs.values())
    out = {"gap_metric": metric, "gap_fallback": fallback, "gap_in_spreads": math.nan}
    out |= {"loss_gap_test": None, "loss_gap_seeds": None}
    out |= dict.fromkeys(LOSS_GAP + SEED_GAPS, math.nan)
    common = [s for s in mine if s in theirs and s is not None]
    if min(len(ours), len(others)) >= 2:
        n1, n2 = len(ours), len(others)
        variance = (
            (n1 - 1) * statistics.variance(ours) + (n2 - 1) * statistics.variance(others)
        ) / (n1 + n2 - 2)
        m1, m2 = statistics.fmean(ours), statistics.fmean(others)
        spread = max(math.sqrt(variance), SPREAD_FLOOR * max(abs(m1), abs(m2)))
        out["gap_in_spreads"] = (m1 - m2) / spread if spread else 0.0
    if min(ours + others, default=1.0) <= 0:
        out["loss_gap_test"] = "no ratio: a loss ≤ 0"
        return out
    seeds: dict = {}  # each seed's own gap
    if len(common) >= 2:
        pairs = [mine[s] for s in common], [theirs[s] for s in common]
        out |= dict(zip(LOSS_GAP, paired(*pairs, level), strict=True))
        out["loss_gap_test"], out["loss_gap_seeds"] = "paired", len(common)
    elif min(len(ours), len(others)) >= 2:
        out |= dict(zip(LOSS_GAP, welch(ours, others, level), strict=True))
        out["loss_gap_test"], out["loss_gap_seeds"] = "welch", f"{len(ours)} and {len(others)}"
    if out["loss_gap_test"]:
        low, high = min(others), max(others)  # no twin: against the baseline seeds' range
        seeds = {s: max(v / high - 1, 0.0) or min(v / low - 1, 0.0) for s, v in mine.items()}
        seeds |= {s: mine[s] / theirs[s] - 1 for s in common}
    elif metric == "eval_loss" and ours and others:
        out["loss_gap"] = statistics.fmean(ours) / statistics.fmean(others) - 1  # one seed
        seeds = {next(iter(mine)): out["loss_gap"]}
    else:
        out["loss_gap"] = g.figures["final_loss_gap"]  # the smoothed training loss
        seeds = {next(iter(mine), None): out["loss_gap"]}
    if seeds and all(math.isfinite(v) for v in seeds.values()):
        worst = max(seeds, key=lambda s: seeds[s])
        own = (seeds[worst], min(seeds.values()), worst, len(seeds), worst in theirs)
        out |= dict(zip(SEED_GAPS, own, strict=True))
    return out


def loss_class(f: dict, tolerance: float) -> str:
    """What the loss gap's interval and its seeds' own gaps say against the tolerance τ:
    "worse" (the interval lies beyond +τ), "worse in a seed" (a seed's own gap against its
    twin beyond +τ, and the row's gap beyond it too), "seed beyond" (a seed's own gap beyond
    +τ that cannot be told from seed luck: against the range of the baseline's seeds, having
    no twin, or in a row whose gap is within +τ, where with n seeds of per-seed noise one of
    them goes past +τ far more often than a single seed would; never recommended, never
    called worse), "untested" (the interval holds +τ: more seeds would tell), "equivalent"
    (the interval and every seed's gap within ±τ), "below" (the whole interval under 0), "no
    worse" (the interval under +τ, and no more than that); with one seed, no interval: "one
    seed" (its gap decides, "worse in a seed" beyond +τ); "no loss" where there is nothing to
    compare."""
    gap, low, high = (f[k] for k in LOSS_GAP)
    worst, best = f["loss_gap_worst_seed"], f["loss_gap_best_seed"]
    if not math.isfinite(gap):
        return "no loss"
    if math.isfinite(low) and low > tolerance:
        return "worse"
    if worst > tolerance and not math.isfinite(low):
        return "worse in a seed"
    if worst > tolerance:
        told = f["loss_gap_worst_seed_twin"] and gap > tolerance
        return "worse in a seed" if told else "seed beyond"
    if not math.isfinite(low):
        return "one seed"
    if high > tolerance:
        return "untested"
    if low >= -tolerance and best >= -tolerance:
        return "equivalent"
    return "below" if high < 0 else "no worse"


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
    """The loss gap's interval in words: its level, its ends, the test, its seeds and what it
    assumes."""
    n = f["loss_gap_seeds"]
    test = (
        f"paired over {n} seeds, assuming normal log ratios"
        if f["loss_gap_test"] == "paired"
        else f"Welch, {n} seeds, assuming normal log losses"
    )
    return (
        f"{percent(f['confidence'])} CI {f['loss_gap_ci_low']:+.2%} to "
        f"{f['loss_gap_ci_high']:+.2%}, {test}"
    )


def _metric_words(f: dict) -> str:
    """The loss compared, in words: the eval loss, or the training loss and why (named)."""
    if f["gap_metric"] == "eval_loss":
        return "eval loss"
    return f"final training loss ({f['gap_fallback']})" if f["gap_fallback"] else "final loss"


def _problem(g: Group, tolerance: float) -> str:
    """Why the group cannot be recommended ("" where nothing is wrong); sets its health."""
    f, bad, base = g.figures, g.unstable, g.base
    f["health"] = bad[0].figures["health"] if bad else "ok"
    if bad:
        return _unstable(g) + " — not recommended" if len(g.jobs) > 1 else bad[0].verdict
    if f["plan_held"] is False:  # it did not run the precision its row names
        mismatch = f["plan_mismatch"]
        return "the precision plan did not hold" + (f": {mismatch}" if mismatch else "")
    if base is None or g is base:
        return ""
    gap, metric, name = f["loss_gap"], _metric_words(f), _name(base)
    if base.unstable:  # nothing judged against it holds
        return f"its baseline {name} is {_unstable(base)}: not judged against it — not recommended"
    kind = loss_class(f, tolerance)
    if kind == "no loss":
        why = f" ({f['loss_gap_test']})" if f["loss_gap_test"] else ""
        return f"{metric} untested: no loss to compare with {name}'s{why} — not recommended"
    if kind == "worse":
        f["health"] = "worse"
        return (
            f"worse than {name}: {metric} {gap:+.2%}, its interval beyond the {percent(tolerance)} "
            f"tolerance ({_ci(f)}) — not recommended"
        )
    if kind == "worse in a seed":
        f["health"] = "worse"
        if not math.isfinite(f["loss_gap_ci_low"]):
            return f"{metric} {gap:+.2%} vs {name} ({_untested(g)}) — not recommended"
        return (
            f"worse than {name} in seed {f['loss_gap_worst_seed_is']}: {metric} "
            f"{f['loss_gap_worst_seed']:+.2%} there, beyond the {percent(tolerance)} tolerance "
            f"(all seeds {gap:+.2%}, {_ci(f)}) — not recommended"
        )
    if kind == "seed beyond":
        against = "its twin's" if f["loss_gap_worst_seed_twin"] else f"{name}'s seeds (no twin)"
        return (
            f"{metric} {gap:+.2%} vs {name}, but seed {f['loss_gap_worst_seed_is']} "
            f"{f['loss_gap_worst_seed']:+.2%} over {against}, beyond the {percent(tolerance)} "
            f"tolerance ({_ci(f)}): a worse mode or an unlucky seed, untested — not recommended"
        )
    if kind == "untested":
        f["undecided"] = "loss gap"  # more seeds would tell (runner/compare/seeds.py)
        return (
            f"{metric} {gap:+.2%} vs {name}, its interval reaching past the {percent(tolerance)} "
            f"tolerance ({_ci(f)}): untested — more seeds would tell"
        )
    return ""


def _unstable(g: Group) -> str:
    """A row's unstable seeds in words: how many, the first one's problem and seed."""
    bad = g.unstable
    first = bad[0].verdict.split(" — ")[0]
    seed = bad[0].config.get("seed", "?")
    return f"unstable in {len(bad)} of {len(g.jobs)} seeds ({first}, seed {seed})"


def _untested(g: Group) -> str:
    few = "one seed" if len(g.jobs) == 1 else "under 2 good seeds here or in the baseline"
    return f"{few}: untested against seed noise"


def _clean(f: dict, tolerance: float) -> str:
    """What seeds none of which went beyond the tolerance cannot exclude: the per-seed failure
    rate they do not rule out at 95%, and the clean seeds that would rule out RULE_OUT."""
    n, tol = f["loss_gap_own_seeds"], percent(tolerance)
    seeds = (
        f"its {n} seeds all within +{tol} (the worst {f['loss_gap_worst_seed']:+.2%}, seed "
        f"{f['loss_gap_worst_seed_is']})"
        if n > 1
        else f"its one seed within +{tol}"
    )
    return (
        f"{seeds}: a seed beyond it up to {clean_bound(n):.0%} of the time is not ruled out at "
        f"{percent(CONFIDENCE)}; {seeds_to_rule_out(RULE_OUT)} such seeds would rule out "
        f"{RULE_OUT:.0%}"
    )


def _loss_words(g: Group, tolerance: float) -> str:
    """The loss of a row fit for a recommendation, in the words its interval and its seeds
    decide, with what its seeds cannot exclude."""
    f, name = g.figures, _name(g.base)
    gap, metric, clean = f["loss_gap"], _metric_words(f), _clean(f, tolerance)
    kind = loss_class(f, tolerance)
    if kind == "one seed":
        return f"{metric} within {abs(gap):.2%} of {name} ({_untested(g)}; {clean})"
    if kind == "below":
        return f"{metric} below {name}'s ({gap:+.2%}, {_ci(f)}; {clean})"
    if kind == "no worse":
        return (
            f"{metric} no worse than {name}'s +{percent(tolerance)} ({gap:+.2%}, {_ci(f)}; {clean})"
        )
    return (
        f"{metric} equivalent to {name}'s within the ±{percent(tolerance)} tolerance "
        f"({gap:+.2%}, {_ci(f)}; {clean})"
    )
