"""The comparison's outputs: the table and its notes (compare.md, compare.csv, compare.json, and
printed), the dashboard (compare.png: loss curves, the loss gap to fp32, speed with its spread,
memory by category; where measured, the largest batch and sequence each row fits: capacity.py),
and the `compare` run in the sweep's W&B group. One row per group of seeds
(runner/compare/verdicts.py): one per job where the sweep has one seed."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from runner import console
from runner.compare import capacity, deployed, finetune, projected, target
from runner.compare.dashboard import plot
from runner.compare.groups import SPEED_RATIOS, contended
from runner.compare.stats import CONFIDENCE, known, percent
from runner.compare.verdicts import in_short
from runner.files import replacing, write_text

if TYPE_CHECKING:
    from runner.compare.groups import Group

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
    ("worst seed gap", "loss_gap_worst_seed", "{:+.1%}"),  # each seed's own, the highest
    ("diverged", "divergence_rate", "{:.0%}"),
    ("max loss gap", "max_loss_gap", "{:.1%}"),
    ("skipped", "skipped_steps", "{}"),
    ("loss scale", "final_loss_scale", "{:g}"),
    ("MFU", "mfu", "{:.1%}"),
    ("low-prec FLOPs", "low_precision_flop_share", "{:.0%}"),
    ("plan held", "plan_held", "{}"),
    ("worst layer", "worst_layer", "{}"),  # its lowest matmul SQNR (summary.json's matmul_error)
    ("verdict", "verdict", "{}"),
]
# where a row converted Linears (fp8, mxfp8, nvfp4, mxfp4): the share of the step's FLOPs in
# that format, which "low-prec FLOPs" (bf16 and the rest together) does not tell apart
CONVERTED = ("fp8/fp4 FLOPs", "converted_flop_share", "{:.0%}")


CONTENDED = "untested (contended)"  # a ratio timed contended (groups.py's `contended`)


def _cell(group: Group, key: str, fmt: str) -> str:
    if (said := target.cell(group, key)) is not None:  # "not reached", "untested"
        return said
    if key in SPEED_RATIOS and contended(group, key):
        return CONTENDED
    cell = _figure(group, key, fmt)
    return f"{cell} (contended)" if contended(group, key) and cell != "—" else cell


def _figure(group: Group, key: str, fmt: str) -> str:
    value = getattr(group, key) if key in ("label", "verdict") else group.figures.get(key)
    if key == "seeds" and group.figures.get("seeds_stopped"):  # runner.seeds=auto: and why
        return f"{value}: {group.figures['seeds_stopped']}"
    if key == "plan_held":  # summary.json's plan_held: a run without one did not test it
        return {True: "yes", False: "no"}.get(value, "untested")
    if not known(value):
        return "—"
    std = group.figures.get(f"{key}_std")  # the losses over several seeds: mean ± std
    low, high = (group.figures.get(f"{key}_ci_{end}") for end in ("low", "high"))
    interval = f" [{fmt.format(low)}, {fmt.format(high)}]" if known(low) else ""
    return fmt.format(value) + (f" ± {fmt.format(std)}" if known(std) else "") + interval


def _notes(groups: list[Group]) -> list[str]:
    """The rows' notes, each once (the modes of one setting share theirs)."""
    notes = [g.figures.get(key) for g in groups for key in ("note", "target_note")]
    return list(dict.fromkeys(note for note in notes if note))


def _level(groups: list[Group]) -> str:
    """The confidence of the comparison's intervals, as the column heads say it (95%, or split
    over the looks of a runner.seeds=auto sweep)."""
    return percent(groups[0].figures.get("confidence", CONFIDENCE) if groups else CONFIDENCE)


def table(groups: list[Group]) -> list[list[str]]:
    # The max-batch columns where the sweep measured it (runner.max_batch=true), and a
    # fine-tune's base and trained parts where a row froze weights, before the verdict.
    extra = (
        (capacity.COLUMNS if capacity.measured(groups) else [])
        + (finetune.COLUMNS if finetune.shown(groups) else [])
        + projected.columns(groups)
    )  # runner.project's estimates, marked so
    columns = COLUMNS[:-1] + extra + COLUMNS[-1:]
    if any(known(g.figures.get("loss_gap_bf16")) for g in groups):  # fp32 and bf16 both swept
        at = [key for _, key, _ in columns].index("loss_gap") + 1
        columns.insert(at, ("gap to bf16 [95% CI]", "loss_gap_bf16", "{:+.1%}"))
    if any(known(g.figures.get("converted_flop_share")) for g in groups):
        at = [key for _, key, _ in columns].index("low_precision_flop_share") + 1
        columns.insert(at, CONVERTED)
    at = [name for name, _, _ in columns].index("samples/s IQR") + 1  # time to target after speed
    columns[at:at] = target.columns(groups)
    level = _level(groups)
    return [[name.replace("95%", level) for name, _, _ in columns]] + [
        [_cell(g, k, f) for _, k, f in columns] for g in groups
    ]


def write(groups: list[Group], sweep_dir: Path) -> dict[str, Path]:
    rows = table(groups)
    paths = {ext: sweep_dir / f"compare.{ext}" for ext in ("md", "csv", "json", "png")}
    md = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    md += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    notes = "".join(f"- {note}\n" for note in _notes(groups))
    write_text(
        paths["md"],
        f"# Precision comparison: {sweep_dir}\n\n"
        + "\n".join(md)
        + (f"\n\nNotes:\n\n{notes}" if notes else "\n")
        + deployed.markdown(groups)  # where jobs evaluated runner.eval_precisions
        + "\n![dashboard](compare.png)\n",
    )
    with replacing(paths["csv"]) as f:
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
            **{k: (v if known(v) else None) for k, v in g.figures.items()},
        }
        for g in groups
    ]
    write_text(paths["json"], json.dumps(records, indent=2) + "\n")
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


# The printed table: what fits a terminal (compare.md has every column); the verdicts whole below.
SHOWN = [
    ("precision", "label", "{}"),
    ("speedup\nstep/target", "speedup", "{:.2f}×"),  # and to the target: _short_cell
    ("eval\nloss", "eval_loss", "{:.4f}"),
    ("gap [95% CI]", "loss_gap", "{:+.1%}"),
    ("mem\nsaving", "memory_saving", "{:+.0%}"),
]


def _short_cell(group: Group, key: str, fmt: str) -> str:
    """As compare.md's cell, the interval's bounds without their % signs: "+0.1% [-2.0, +2.2]"."""
    cell = _cell(group, key, fmt)
    if key == "speedup" and known(group.figures.get("target")):  # "1.31×/0.92×": to the target
        if contended(group, key):
            return "contended"
        to = _cell(group, "time_to_target_speedup", fmt).partition(" [")[0]
        short = {"not reached": "never", "untested": "?"}.get(to, to)
        return f"{cell}/{short}"
    head, bracket, interval = cell.partition(" [")
    return head + bracket + interval.replace("%", "") if bracket else cell


def show(groups: list[Group], sweep_dir: Path, paths: dict[str, Path]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    out = Console()  # the terminal's width (80 columns where stdout is not a terminal)
    shown = Table(
        title=f"precision comparison — {sweep_dir}",
        title_justify="left",
        box=None,
        pad_edge=False,
        header_style="bold underline",
    )
    columns = SHOWN + projected.terminal_columns(groups)  # runner.project's, marked an estimate
    level = _level(groups)
    for name, _, _ in columns:
        name = name.replace("95%", level)
        shown.add_column(name, justify="left" if name == "precision" else "right", no_wrap=True)
    shown.add_column("verdict", ratio=1, overflow="fold")
    # Labels, verdicts and notes are text, never markup: a failed job's error may hold brackets
    # ("[/pytorch/third_party/gloo/...] Read error"), which rich would read as a closing tag.
    for g in groups:
        cells = (*(_short_cell(g, k, f) for _, k, f in columns), in_short(g.verdict))
        shown.add_row(*map(escape, cells))
    out.print(shown)
    for g in groups:
        stopped = g.figures.get("seeds_stopped")  # runner.seeds=auto: the seeds it took, and why
        seeds = f" ({len(g.jobs)} seeds, {stopped})" if stopped else ""
        out.print(f"{g.label}{seeds}: {g.verdict}", highlight=False, soft_wrap=True, markup=False)
    deployed.show(groups)
    for note in _notes(groups):
        out.print(f"note: {note}", highlight=False, soft_wrap=True, markup=False)
    out.print(
        f"written: {', '.join(str(p) for p in paths.values())}", highlight=False, soft_wrap=True
    )
