"""The largest micro-batch each row fits (runner.max_batch=true; runner/answers/max_batch.py finds
it before each job trains): each row's max_batch as a multiple of its setting's fp32 row's, the
table's columns and the dashboard's bars. Shown only where the sweep measured it."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.compare.groups import Group

# Where a sweep measured them, before the verdict.
COLUMNS = [
    ("max batch", "max_batch", "{:.0f}"),
    ("× fp32's", "max_batch_vs_fp32", "{:.2f}×"),
    ("max seq", "max_seq_len", "{:.0f}"),
]
KNOBS = ("max_batch", "max_seq_len")


def job_figures(summary: dict) -> dict:
    """A job's sizes from its summary.json (None where not measured; a row's median of them is
    then NaN, so a row's figures are numbers)."""
    return {knob: summary.get(knob) for knob in KNOBS}


def own(g: Group, max_batch: float) -> dict:
    """How its typical seed's sizes were found (the first whose max_batch is the row's)."""
    jobs = g.counted
    typical = next((j for j in jobs if j.figures["max_batch"] == max_batch), jobs[0])
    return {f"{knob}_method": typical.summary.get(f"{knob}_method") for knob in KNOBS}


def against(g: Group, base: Group | None) -> float:
    """max_batch_vs_fp32: its max_batch over its setting's fp32 row's (NaN without one)."""
    ours = g.figures["max_batch"]
    fp32 = base is not None and base.precision == "fp32"
    theirs = base.figures["max_batch"] if fp32 else math.nan
    return ours / theirs if math.isfinite(ours) and math.isfinite(theirs) and theirs else math.nan


def measured(groups: list[Group]) -> bool:
    return any(math.isfinite(g.figures["max_batch"]) for g in groups)


def panel(ax, groups: list[Group], knob: str) -> None:
    """A bar per row: its max_batch (labelled with its multiple of its fp32 row's) or its
    max_seq_len, titled with the budget they fit."""
    x = list(range(len(groups)))
    sizes = [g.figures[knob] for g in groups]
    bars = ax.bar(x, [s if math.isfinite(s) else 0 for s in sizes], color=[f"C{i}" for i in x])
    for bar, g, size in zip(bars, groups, sizes, strict=True):
        if not math.isfinite(size):
            continue
        times = g.figures["max_batch_vs_fp32"] if knob == "max_batch" else math.nan
        label = f"{size:.0f}" + (f" ({times:.2f}×)" if math.isfinite(times) else "")
        top = (bar.get_x() + bar.get_width() / 2, bar.get_height())
        ax.annotate(label, top, ha="center", va="bottom", fontsize="small")
    fits = [j.summary.get(f"{knob}_fit") or {} for g in groups for j in g.jobs]
    budgets = sorted({round(f["budget_mb"]) for f in fits if f.get("budget_mb")})
    within = f" within {', '.join(f'{b} MB' for b in budgets)}" if budgets else ""
    what = "micro-batch (samples)" if knob == "max_batch" else "sequence (tokens)"
    ax.set_xticks(x, [g.label for g in groups], rotation=20, fontsize="small")
    ax.set(ylabel=what, title=f"largest {what}{within}")
