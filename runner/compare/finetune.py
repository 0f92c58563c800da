"""A fine-tune's two parts in the comparison (model.peft, model.freeze): the frozen base's weights
and what training the rest holds (its weights, gradients, optimizer state and fp32 masters), from
summary.json's `memory`, so a sweep shows what a bf16 base saves beside its loss gap. Shown only
where a row froze weights."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.compare.groups import Group

# Before the verdict, where a row froze weights.
COLUMNS = [
    ("base MB", "frozen_mb", "{:.1f}"),
    ("trained MB", "trained_mb", "{:.1f}"),
]
TRAINED = ("params", "grads", "optimizer", "masters")  # `memory`'s categories of what trains


def job_figures(summary: dict) -> dict:
    """A job's two parts in MB (NaN where its summary has no `memory`: a failed or older run)."""
    memory = summary.get("memory") or {}
    if "frozen" not in memory:
        return {"frozen_mb": math.nan, "trained_mb": math.nan}
    return {
        "frozen_mb": memory["frozen"]["mb"],
        "trained_mb": sum(memory[k]["mb"] for k in TRAINED),
    }


def shown(groups: list[Group]) -> bool:
    return any(g.figures.get("frozen_mb", 0) > 0 for g in groups)
