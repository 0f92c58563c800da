"""The projection in the comparison (runner.project; runner/measure/projection.py): each row's
projected speedup over its baseline row and projected MFU on one GPU (H100 where the sweep
projected it, else its first), as columns marked as estimates, and a clause after the verdict
that says what a run on that GPU should check. A projection is never a measurement: it never
makes a row recommended, and its words never call it measured."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from runner.summary_aliases import converted_section

if TYPE_CHECKING:
    from runner.compare.groups import Group

PREFERRED = "H100 SXM"


def gpu(groups: list[Group]) -> str | None:
    """The GPU the columns show: H100 where projected, else the first GPU any row projected."""
    names = [n for g in groups for n in (g.jobs[0].summary.get("projection") or {})]
    return PREFERRED if PREFERRED in names else (names[0] if names else None)


def columns(groups: list[Group]) -> list[tuple[str, str, str]]:
    name = gpu(groups)
    if name is None:
        return []
    short = name.split()[0]
    return [
        (f"projected {short} speedup (estimate)", "projected_speedup", "{:.2f}×"),
        (f"projected {short} MFU (estimate)", "projected_mfu", "{:.1%}"),
    ]


def terminal_columns(groups: list[Group]) -> list[tuple[str, str, str]]:
    """The printed table's one projected column, where a row has a projection: the speedup, its
    header naming the GPU and saying "estimate" (compare.md has both columns in full)."""
    if not shown(groups):
        return []
    return [(f"{gpu(groups).split()[0]} est.\nspeedup", "projected_speedup", "{:.2f}×")]


def _row(g: Group, name: str) -> dict:
    projection = g.jobs[0].summary.get("projection") or {}
    return (projection.get(name) or {}).get(g.precision) or {}


def fill(groups: list[Group]) -> None:
    """Each row's projected figures (NaN where not projected) and the verdict's clauses: where
    its mode (fp8, mxfp8, nvfp4, mxfp4) converted no Linear, which rules kept each one, so that
    its 1.00× reads as the bf16 it ran; then its projection. Called after the verdicts are
    judged: nothing here changes which row is recommended."""
    name = gpu(groups)
    for g in groups:
        ours = _row(g, name) if name else {}
        base = _row(g.base, name) if name and g.base is not None else {}
        t, t_base = ours.get("step_time_s"), base.get("step_time_s")
        speedup = (
            t_base / t
            if t and t_base
            else ours.get(f"speedup_vs_{getattr(g.base, 'precision', 'fp32')}")
        )
        g.figures["projected_gpu"] = name
        g.figures["projected_speedup"] = speedup if speedup else math.nan
        g.figures["projected_mfu"] = ours.get("mfu") if ours.get("mfu") is not None else math.nan
        g.figures["projected_step_time_s"] = t if t else math.nan
        if words := converted_section(g.jobs[0].summary).get("nothing_converted"):
            g.verdict += f"; {g.precision} {words}"  # a converting mode that converted nothing
        if t and speedup and g.base is not None and g.base is not g:
            g.verdict += (
                f"; projected on {name}: {speedup:.2f}× {g.base.label}'s step (an estimate from "
                f"the audited step, never run there: a run on {name} should check its step time"
                + (f" and its {ours['max_batch']}-sample batch)" if ours.get("max_batch") else ")")
            )


def shown(groups: list[Group]) -> bool:
    """Whether any row has a projection to draw."""
    return any(math.isfinite(g.figures.get("projected_speedup", math.nan)) for g in groups)


def panel(ax, groups: list[Group], key: str) -> None:
    """A bar per row: its projected speedup over its baseline's step, or its projected MFU, on
    the GPU the columns show, titled as the estimate it is."""
    x = list(range(len(groups)))
    values = [g.figures.get(key, math.nan) for g in groups]
    bars = ax.bar(x, [v if math.isfinite(v) else 0 for v in values], color=[f"C{i}" for i in x])
    for bar, value in zip(bars, values, strict=True):
        label = (
            "—"
            if not math.isfinite(value)
            else (f"{value:.2f}×" if key == "projected_speedup" else f"{value:.1%}")
        )
        top = (bar.get_x() + bar.get_width() / 2, bar.get_height())
        ax.annotate(label, top, ha="center", va="bottom", fontsize="small")
    name = next(
        (g.figures.get("projected_gpu") for g in groups if g.figures.get("projected_gpu")), ""
    )
    what = "speedup over its baseline's step" if key == "projected_speedup" else "MFU"
    ax.set_xticks(x, [g.label for g in groups], rotation=20, fontsize="small")
    ax.set(title=f"projected {name} {what} (estimate, not measured)")
