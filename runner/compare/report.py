"""The comparison's outputs: the table and its notes (compare.md, compare.csv, compare.json, and
printed), the dashboard (compare.png: loss curves, the loss gap to fp32, speed with its spread,
memory by category; where measured, the largest batch and sequence each row fits: capacity.py),
and the `compare` run in the sweep's W&B group. One row per group of seeds
(runner/compare/verdicts.py): one per job where the sweep has one seed."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from runner import console
from runner.compare import capacity, deployed
from runner.compare.groups import scales_loss
from runner.compare.stats import median

if TYPE_CHECKING:
    from runner.compare.groups import Group

MEMORY = ("params", "grads", "optimizer", "masters", "activations")  # summary.json's `memory`


def as_float(value) -> float:
    """A figure from a summary or a row: NaN where it is missing."""
    return float(value) if value is not None else math.nan


COLUMNS = [
    ("precision", "label", "{}"),
    ("samples/s", "samples_per_s", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}×"),
    ("samples/s IQR", "samples_per_s_iqr", "{:.1f}"),
    ("memory MB", "memory_mb", "{:.1f}"),
    ("mem saving", "memory_saving", "{:+.0%}"),
    ("seeds", "seeds", "{}"),
    ("final loss", "final_loss", "{:.4f}"),
    ("eval loss", "eval_loss", "{:.4f}"),
    ("loss gap [95% CI]", "loss_gap", "{:+.1%}"),
    ("diverged", "divergence_rate", "{:.0%}"),
    ("max loss gap", "max_loss_gap", "{:.1%}"),
    ("skipped", "skipped_steps", "{}"),
    ("loss scale", "final_loss_scale", "{:g}"),
    ("MFU", "mfu", "{:.1%}"),
    ("low-prec FLOPs", "low_precision_flop_share", "{:.0%}"),
    ("verdict", "verdict", "{}"),
]


def _known(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _cell(group: Group, key: str, fmt: str) -> str:
    value = getattr(group, key) if key in ("label", "verdict") else group.figures.get(key)
    if not _known(value):
        return "—"
    std = group.figures.get(f"{key}_std")  # the losses over several seeds: mean ± std
    low, high = (group.figures.get(f"{key}_ci_{end}") for end in ("low", "high"))
    interval = f" [{fmt.format(low)}, {fmt.format(high)}]" if _known(low) else ""
    return fmt.format(value) + (f" ± {fmt.format(std)}" if _known(std) else "") + interval


def _notes(groups: list[Group]) -> list[str]:
    """The rows' notes, each once (the modes of one setting share theirs)."""
    return list(dict.fromkeys(g.figures["note"] for g in groups if g.figures.get("note")))


def table(groups: list[Group]) -> list[list[str]]:
    # The max-batch columns where the sweep measured it (runner.max_batch=true), before the verdict.
    columns = COLUMNS[:-1] + (capacity.COLUMNS if capacity.measured(groups) else []) + COLUMNS[-1:]
    return [[name for name, _, _ in columns]] + [
        [_cell(g, k, f) for _, k, f in columns] for g in groups
    ]


def smoothed(steps: list[int], values: list[float], window: int) -> dict[int, float]:
    """Each step's trailing mean over `window` values."""
    out = {}
    for i, step in enumerate(steps):
        chunk = values[max(0, i - window + 1) : i + 1]
        out[step] = sum(chunk) / len(chunk)
    return out


def _curve(group: Group) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps, and the mean, least and greatest loss at each over the group's good seeds."""
    by_step: dict[int, list[float]] = {}
    for job in group.counted:
        for r in job.rows:
            if math.isfinite(as_float(r.get("loss"))):
                by_step.setdefault(r["step"], []).append(r["loss"])
    steps = sorted(by_step)
    losses = [by_step[s] for s in steps]
    return (
        steps,
        [sum(v) / len(v) for v in losses],
        [min(v) for v in losses],
        [max(v) for v in losses],
    )


def _losses(ax, groups: list[Group]) -> None:
    """Each group's mean loss curve, a min–max band over its seeds, the fp16 loss scale; a
    group's colour (C0, C1, ... by its place) is the same in every panel."""
    scale_ax = None
    for i, group in enumerate(groups):
        steps, mean, low, high = _curve(group)
        seeds, label = len(group.counted), group.label
        if len(group.jobs) > 1:
            of = f" of {len(group.jobs)}" if seeds < len(group.jobs) else ""
            label += f" (mean of {seeds}{of} seeds, band: min–max)"
        if steps:
            ax.plot(steps, mean, label=label, linewidth=1.2, color=f"C{i}")
            if seeds > 1:
                ax.fill_between(steps, low, high, color=f"C{i}", alpha=0.2, linewidth=0)
        scaled = [j for j in group.counted if j.rows] if scales_loss(group.precision) else []
        for k, job in enumerate(scaled):
            scale_ax = scale_ax or ax.twinx()
            scale_ax.plot(
                [r["step"] for r in job.rows],
                [r["loss_scale"] for r in job.rows],
                "--",
                color=f"C{i}",
                linewidth=1,
                label="_nolegend_" if k else f"{group.label} loss scale",
            )
    ax.set(xlabel="optimizer step", ylabel="training loss", title="loss by precision")
    handles, labels = ax.get_legend_handles_labels()
    if scale_ax is not None:
        scale_ax.set_yscale("log")
        scale_ax.set_ylabel("fp16 loss scale")
        h2, l2 = scale_ax.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="upper right", fontsize="small")


def _gaps(ax, groups: list[Group]) -> None:
    """Each group's mean loss relative to its baseline's, step by step, both smoothed over a
    tenth of the steps."""
    for i, group in enumerate(groups):
        base = group.base
        if base is None or base is group:
            continue
        (steps, mean, _, _), (base_steps, base_mean, _, _) = _curve(group), _curve(base)
        window = max(1, min(len(steps), len(base_steps)) // 10)
        ours, theirs = smoothed(steps, mean, window), smoothed(base_steps, base_mean, window)
        shared = sorted(k for k in ours.keys() & theirs.keys() if theirs[k])
        gap = [100 * (ours[k] - theirs[k]) / abs(theirs[k]) for k in shared]
        ax.plot(shared, gap, label=group.label, linewidth=1.2, color=f"C{i}")
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set(
        xlabel="optimizer step", ylabel="loss vs baseline (%)", title="loss gap to fp32 (smoothed)"
    )
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _speed(ax, groups: list[Group]) -> None:
    """Each group's samples/s, whiskers its interquartile range; a step too small to tell is
    hatched."""
    x = range(len(groups))
    speed = [g.figures.get("samples_per_s", math.nan) for g in groups]
    iqr = [g.figures.get("samples_per_s_iqr", math.nan) for g in groups]
    whiskers = [v / 2 if _known(v) else 0 for v in iqr]
    bars = ax.bar(x, speed, yerr=whiskers, capsize=4, color=[f"C{i}" for i in x])
    for bar, g in zip(bars, groups, strict=True):
        if g.figures.get("speed_emulated"):
            bar.set_hatch("..")
            bar.set_label("emulated: fp32 matmuls")
        elif g.figures.get("too_small_to_tell"):
            bar.set_hatch("//")
            bar.set_label("step too small to tell")
    ax.set_xticks(list(x), [g.label for g in groups], rotation=20, fontsize="small")
    timing = ", ".join(sorted({g.figures["speed_source"] for g in groups}))
    timing = timing.replace("jobs", "per-job")
    ax.set(ylabel="samples/s", title=f"speed ({timing} timing; whiskers: IQR)")
    handles, labels = ax.get_legend_handles_labels()
    if handles:  # one entry per kind of hatch
        kinds = dict(zip(labels, handles, strict=True))
        ax.legend(list(kinds.values()), list(kinds), fontsize="small")


def _memory(ax, groups: list[Group]) -> None:
    """summary.json's `memory` by category (a typical seed's), else the peak; else a note."""

    def mb(job, key) -> float:
        value = (job.summary.get("memory") or {}).get(key)
        return as_float(value["mb"] if isinstance(value, dict) else value)

    x = list(range(len(groups)))
    if any(j.summary.get("memory") for g in groups for j in g.jobs):
        bottom = [0.0] * len(groups)
        for key in MEMORY:
            heights = [median(mb(j, key) for j in g.counted) for g in groups]
            heights = [h if math.isfinite(h) else 0.0 for h in heights]  # e.g. no masters
            ax.bar(x, heights, bottom=bottom, label=key)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        peaks = [median(mb(j, "peak") for j in g.counted) for g in groups]
        if any(math.isfinite(p) for p in peaks):  # CUDA's; a CPU process's peak is not the job's
            ax.plot(x, peaks, "k_", markersize=20, label="measured peak")
        ax.legend(fontsize="small")
    elif any(_known(g.figures.get("peak_memory_mb")) for g in groups):
        ax.bar(x, [g.figures.get("peak_memory_mb", math.nan) for g in groups], label="peak")
    else:
        ax.text(0.5, 0.5, "no memory figures", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks(x, [g.label for g in groups], rotation=20, fontsize="small")
    ax.set(ylabel="MB", title="memory by category")


def plot(groups: list[Group], path: Path) -> None:
    """compare.png: a 2×2 dashboard."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sized = capacity.measured(groups)  # a third column: the largest batch and sequence
    fig, axes = plt.subplots(2, 3 if sized else 2, figsize=(21 if sized else 14, 9))
    _losses(axes[0][0], groups)
    _gaps(axes[0][1], groups)
    _speed(axes[1][0], groups)
    _memory(axes[1][1], groups)
    if sized:
        capacity.panel(axes[0][2], groups, "max_batch")
        capacity.panel(axes[1][2], groups, "max_seq_len")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(groups: list[Group], sweep_dir: Path) -> dict[str, Path]:
    rows = table(groups)
    paths = {ext: sweep_dir / f"compare.{ext}" for ext in ("md", "csv", "json", "png")}
    md = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    md += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    notes = "".join(f"- {note}\n" for note in _notes(groups))
    paths["md"].write_text(
        f"# Precision comparison: {sweep_dir}\n\n"
        + "\n".join(md)
        + (f"\n\nNotes:\n\n{notes}" if notes else "\n")
        + deployed.markdown(groups)  # where jobs evaluated runner.eval_precisions
        + "\n![dashboard](compare.png)\n"
    )
    with open(paths["csv"], "w", newline="") as f:
        csv.writer(f).writerows(rows)
    records = [
        {
            "job": g.jobs[0].folder.name,  # the first seed's
            "jobs": [j.folder.name for j in g.jobs],
            "precision": g.precision,
            "label": g.label,
            "status": g.status,
            "verdict": g.verdict,
            **({"eval_precisions": e} if (e := g.jobs[0].summary.get("eval_precisions")) else {}),
            **{k: (v if _known(v) else None) for k, v in g.figures.items()},
        }
        for g in groups
    ]
    paths["json"].write_text(json.dumps(records, indent=2) + "\n")
    plot(groups, paths["png"])
    return paths


def log_to_wandb(groups: list[Group], sweep_dir: Path, paths: dict[str, Path]) -> None:
    """The table and the plot as a `compare` run in the sweep's W&B group (where jobs used W&B)."""
    jobs = [j for g in groups for j in g.jobs]
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
        rows = table(groups)
        run.log(
            {
                "comparison": wandb.Table(columns=rows[0], data=rows[1:]),
                "dashboard": wandb.Image(str(paths["png"])),
            }
        )
        run.finish()
    except Exception as e:
        console.say(f"[yellow]warning:[/] W&B logging of the comparison failed ({e})")


def show(groups: list[Group], sweep_dir: Path, paths: dict[str, Path]) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = table(groups)
    shown = Table(title=f"precision comparison — {sweep_dir}", title_justify="left")
    for name in rows[0]:
        shown.add_column(name, overflow="fold")
    for r in rows[1:]:
        shown.add_row(*r)
    Console(width=None if sys.stdout.isatty() else 200).print(shown)
    deployed.show(groups)
    for note in _notes(groups):
        print(f"note: {note}")
    print(f"written: {', '.join(str(p) for p in paths.values())}")
