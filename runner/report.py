"""The comparison's outputs: the table (compare.md, compare.csv, compare.json, and printed), the
loss plot (compare.png), and the `compare` run in the sweep's W&B group."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from runner import console
from runner.config import LOSS_SCALED_MODES

if TYPE_CHECKING:
    from runner.compare import Job


def as_float(value) -> float:
    """A figure from a summary or a row: NaN where it is missing."""
    return float(value) if value is not None else math.nan


COLUMNS = [
    ("precision", "label", "{}"),
    ("samples/s", "samples_per_s", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}×"),
    ("peak MB", "peak_memory_mb", "{:.0f}"),
    ("mem saving", "memory_saving", "{:+.0%}"),
    ("final loss", "final_loss", "{:.4f}"),
    ("eval loss", "eval_loss", "{:.4f}"),
    ("max loss gap", "max_loss_gap", "{:.1%}"),
    ("skipped", "skipped_steps", "{}"),
    ("loss scale", "final_loss_scale", "{:g}"),
    ("MFU", "mfu", "{:.1%}"),
    ("low-prec FLOPs", "low_precision_flop_share", "{:.0%}"),
    ("verdict", "verdict", "{}"),
]


def _cell(job: Job, key: str, fmt: str) -> str:
    value = getattr(job, key) if key in ("label", "verdict") else job.figures.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return fmt.format(value)


def table(jobs: list[Job]) -> list[list[str]]:
    return [[name for name, _, _ in COLUMNS]] + [
        [_cell(j, k, f) for _, k, f in COLUMNS] for j in jobs
    ]


def plot(jobs: list[Job], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    scale_ax = None
    for job in jobs:
        rows = [r for r in job.rows if math.isfinite(as_float(r.get("loss")))]
        if rows:
            ax.plot(
                [r["step"] for r in rows], [r["loss"] for r in rows], label=job.label, linewidth=1.2
            )
        if job.precision in LOSS_SCALED_MODES and job.rows:
            scale_ax = scale_ax or ax.twinx()
            scale_ax.plot(
                [r["step"] for r in job.rows],
                [r["loss_scale"] for r in job.rows],
                "--",
                color="grey",
                linewidth=1,
                label=f"{job.label} loss scale",
            )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("loss by precision")
    handles, labels = ax.get_legend_handles_labels()
    if scale_ax is not None:
        scale_ax.set_yscale("log")
        scale_ax.set_ylabel("fp16 loss scale")
        h2, l2 = scale_ax.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(jobs: list[Job], sweep_dir: Path) -> dict[str, Path]:
    rows = table(jobs)
    paths = {ext: sweep_dir / f"compare.{ext}" for ext in ("md", "csv", "json", "png")}
    md = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    md += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    paths["md"].write_text(
        f"# Precision comparison: {sweep_dir}\n\n" + "\n".join(md) + "\n\n![loss](compare.png)\n"
    )
    with open(paths["csv"], "w", newline="") as f:
        csv.writer(f).writerows(rows)
    records = [
        {
            "job": j.folder.name,
            "precision": j.precision,
            "label": j.label,
            "status": j.summary.get("status"),
            "verdict": j.verdict,
            **{
                k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in j.figures.items()
            },
        }
        for j in jobs
    ]
    paths["json"].write_text(json.dumps(records, indent=2) + "\n")
    plot(jobs, paths["png"])
    return paths


def log_to_wandb(jobs: list[Job], sweep_dir: Path, paths: dict[str, Path]) -> None:
    """The table and the plot as a `compare` run in the sweep's W&B group (where jobs used W&B)."""
    logger = next((j.config.get("logger") for j in jobs if j.config.get("logger")), None)
    if not logger or logger.get("backend") != "wandb" or logger.get("mode") == "disabled":
        return
    import wandb

    group = logger.get("group") or f"{sweep_dir.resolve().parent.name}-{sweep_dir.resolve().name}"
    try:
        run = wandb.init(
            project=logger.get("project"),
            entity=logger.get("entity"),
            group=group,
            job_type="compare",
            name="compare",
            dir=str(sweep_dir),
            mode=os.environ.get("WANDB_MODE", logger.get("mode")),
            reinit="finish_previous",
            settings=wandb.Settings(silent=True, console="off"),
        )
        rows = table(jobs)
        run.log(
            {
                "comparison": wandb.Table(columns=rows[0], data=rows[1:]),
                "loss_by_precision": wandb.Image(str(paths["png"])),
            }
        )
        run.finish()
    except Exception as e:
        console.say(f"[yellow]warning:[/] W&B logging of the comparison failed ({e})")


def show(jobs: list[Job], sweep_dir: Path, paths: dict[str, Path]) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = table(jobs)
    shown = Table(title=f"precision comparison — {sweep_dir}", title_justify="left")
    for name in rows[0]:
        shown.add_column(name, overflow="fold")
    for r in rows[1:]:
        shown.add_row(*r)
    Console(width=None if sys.stdout.isatty() else 200).print(shown)
    print(f"written: {', '.join(str(p) for p in paths.values())}")
