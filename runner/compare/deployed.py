"""The comparison's inference-precision table: each row's final weights evaluated in the
precisions of runner.eval_precisions (runner/answers/inference.py), where its jobs were: one per
precision evaluated, from the row's first seed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.answers import inference

if TYPE_CHECKING:
    from runner.compare.groups import Group


def table(groups: list[Group]) -> list[list[str]]:
    """Header and rows; [] where no job evaluated any."""
    runs = {
        g.label: g.jobs[0].summary["eval_precisions"]
        for g in groups
        if g.jobs[0].summary.get("eval_precisions")
    }
    return inference.table(runs) if runs else []


def markdown(groups: list[Group]) -> str:
    rows = table(groups)
    if not rows:
        return ""
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n## Inference precision (the final weights)\n\n" + "\n".join(lines) + "\n"


def show(groups: list[Group]) -> None:
    if rows := table(groups):
        inference.show(rows, "inference precision (each row's final weights)")
