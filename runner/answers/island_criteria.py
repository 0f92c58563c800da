"""What "trains as fp32 does" means for a trial of the fp32 islands search
(runner/answers/island_search.py): the scaler's first calibration, the range fault (a non-finite
loss, or too many skipped steps once the scale had settled) and the loss fault (a mean loss too far
from fp32's), and the module the forensics put at fault."""

from __future__ import annotations

import math

# What "trains as fp32 does" allows, after the scaler's first calibration: skipped steps (an
# occasional overflow the scaler backs off from), and the relative gap of the mean loss.
MAX_SKIPPED_SHARE = 0.05
LOSS_TOLERANCE = 0.05


def fp32_share(summary: dict) -> float | None:
    """The share of the audited step's FLOPs that ran in fp32 (the islands' cost in speed)."""
    flops = summary.get("flops_per_step")
    return sum(summary.get("fp32_ops", {}).values()) / flops if flops else None


def culprit(report: dict) -> str | None:
    """The module to keep in fp32 next: the first non-finite output in the forward pass, else the
    first non-finite incoming gradient in backward order."""
    return report["forward"]["first_nonfinite"] or report["backward"]["first_nonfinite"]


def calibration(rows: list[dict]) -> int:
    """How many steps the scaler's first calibration took: the skipped steps at the start, each
    followed by a lower loss scale, up to the first applied step (0 where none follows: the
    scale never settled; and without a scaler, whose scale stays 1)."""
    n = 0
    while n + 1 < len(rows) and rows[n]["skipped"]:
        if rows[n + 1]["loss_scale"] >= rows[n]["loss_scale"]:
            return 0
        n += 1
    return n if n < len(rows) and not rows[n]["skipped"] else 0


def range_fault(rows: list[dict]) -> tuple[str, int] | None:
    """Why `rows` (a trial's metrics) overflow, and the step to replay for it: the first
    non-finite loss, else the first skipped step once the loss scale had settled where more than
    MAX_SKIPPED_SHARE of those steps are skipped. None: they do not."""
    for row in rows:
        if not math.isfinite(row["loss"]):
            return f"non-finite loss at step {row['step']}", row["step"]
    calibrated = calibration(rows)
    settled = rows[calibrated:]
    skipped = [r["step"] for r in settled if r["skipped"]]
    if len(skipped) > MAX_SKIPPED_SHARE * len(settled):
        after = f" after the loss scale's first calibration (steps 1-{calibrated})"
        return (
            f"{len(skipped)} of {len(settled)} steps skipped{after if calibrated else ''}",
            skipped[0],
        )
    return None


def loss_fault(rows: list[dict], reference: list[dict]) -> str | None:
    """Why `rows`' loss is not fp32's (`reference`, the same run in fp32): their mean loss over
    the steps after the scaler's first calibration more than LOSS_TOLERANCE apart. None: it is."""
    settled = rows[calibration(rows) :]
    steps = {r["step"] for r in settled}
    theirs = [r["loss"] for r in reference if r["step"] in steps]
    if not settled or len(theirs) != len(settled):
        return None  # nothing to compare, or fp32 stopped early: range_fault's to judge
    loss, fp32 = sum(r["loss"] for r in settled) / len(settled), sum(theirs) / len(theirs)
    if abs(loss - fp32) <= LOSS_TOLERANCE * abs(fp32):
        return None
    return (
        f"mean loss {loss:.4g} against fp32's {fp32:.4g} over steps {settled[0]['step']}-"
        f"{settled[-1]['step']} (more than {LOSS_TOLERANCE:.0%} apart)"
    )
