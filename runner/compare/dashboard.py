"""The comparison's dashboard (compare.png): the loss curves, the loss gaps to the baseline, the
speeds with their spread and the memory by category, a panel each; a third column of panels
where the sweep measured the largest batch (capacity.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from runner.compare import capacity, projected, target
from runner.compare.groups import contended, scales_loss
from runner.compare.stats import as_float, known, median

if TYPE_CHECKING:
    from runner.compare.groups import Group

# summary.json's `memory`: "params" are the weights that train, "frozen" those that do not
MEMORY = ("params", "frozen", "grads", "optimizer", "masters", "activations")


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
    """Each group's median samples/s, whiskers its first and third quartiles (a typical seed's);
    a step too small to tell is hatched."""
    x = range(len(groups))
    speed = [g.figures.get("samples_per_s", math.nan) for g in groups]
    below, above = [], []  # the whiskers from the bar's top: to the quartiles, where known
    for g, top in zip(groups, speed, strict=True):
        q1, q3 = (g.figures.get(f"samples_per_s_{q}", math.nan) for q in ("q1", "q3"))
        below.append(max(top - q1, 0) if known(q1) and known(top) else 0)
        above.append(max(q3 - top, 0) if known(q3) and known(top) else 0)
    bars = ax.bar(x, speed, yerr=[below, above], capsize=4, color=[f"C{i}" for i in x])
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
    ax.set(ylabel="samples/s", title=f"speed ({timing} timing; whiskers: quartiles)")
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
    elif any(known(g.figures.get("peak_memory_mb")) for g in groups):
        ax.bar(x, [g.figures.get("peak_memory_mb", math.nan) for g in groups], label="peak")
    else:
        ax.text(0.5, 0.5, "no memory figures", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks(x, [g.label for g in groups], rotation=20, fontsize="small")
    ax.set(ylabel="MB", title="memory by category")


def _target_line(ax, groups: list[Group]) -> None:
    values = sorted({g.figures["target"] for g in groups if known(g.figures.get("target"))})
    for k, value in enumerate(values):
        label = "target" if len(values) == 1 else f"target {value:.4g}"
        ax.axhline(value, color="k", linestyle=":", linewidth=1, label=label if k < 3 else None)


def eval_against(ax, groups: list[Group], axis: str) -> None:
    """Each row's smoothed eval curve (the mean over its good seeds) against the time
    (`axis` "time": steps × its step time, as its time to target counts it) or the tokens
    (or samples) seen, the target drawn, and where each row reaches it marked."""
    metric = next(
        (g.figures["target_metric"] for g in groups if g.figures.get("target_metric")), "eval_loss"
    )
    counted = (
        "tokens" if any(known(g.figures.get("tokens_to_target")) for g in groups) else "samples"
    )
    for i, g in enumerate(groups):
        steps, values, seconds, seen = target.curve(g, metric)
        xs = seconds if axis == "time" else seen
        if steps and any(known(x) for x in xs):
            ax.plot(xs, values, marker=".", linewidth=1.2, color=f"C{i}", label=g.label)
        at = g.figures.get("time_to_target_s" if axis == "time" else f"{counted}_to_target")
        if known(at) and g.figures.get("target_status") == "reached":
            ax.plot([at], [g.figures["target"]], "o", color=f"C{i}", markersize=7)
    _target_line(ax, groups)
    name = metric.replace("_", " ")
    if axis == "time":
        sources = sorted({g.figures["time_source"] for g in groups if g.figures.get("time_source")})
        how = ", ".join(sources).replace("jobs", "per-job") or "no"
        ax.set(xlabel=f"seconds (steps × step time: {how} timing)", ylabel=name)
        ax.set_title(f"{name} against wall time (smoothed; dot: reaches the target)")
    else:
        ax.set(xlabel=f"{counted} seen", ylabel=name, title=f"{name} against {counted}")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def time_to_target(ax, groups: list[Group], key: str = "time_to_target_s") -> None:
    """A bar per row: its mean time (or steps) to the target, whiskers its 95% interval over
    seeds; a row that never reached it, or whose evaluations were too sparse, says so."""
    x = list(range(len(groups)))
    tops = [g.figures.get(key, math.nan) for g in groups]
    heights = [t if known(t) else 0.0 for t in tops]
    below, above = [], []
    for g, top in zip(groups, tops, strict=True):
        low, high = (g.figures.get(f"{key}_ci_{end}", math.nan) for end in ("low", "high"))
        below.append(max(top - low, 0) if known(low) and known(top) else 0)
        above.append(max(high - top, 0) if known(high) and known(top) else 0)
    bars = ax.bar(x, heights, yerr=[below, above], capsize=4, color=[f"C{i}" for i in x])
    for bar, g, top in zip(bars, groups, tops, strict=True):
        status = g.figures.get("target_status")
        words = {"not reached": "not reached", "too sparse": "too sparse", "no curve": "no curve"}
        if status in words or not known(top):
            bar.set_hatch("//")
            label = words.get(status, "untested")
        else:
            speedup = g.figures.get("time_to_target_speedup")
            label = f"{speedup:.2f}×" if known(speedup) and key == "time_to_target_s" else ""
            if label and contended(g, "time_to_target_speedup"):  # another process's, not its
                label = "contended"
        ax.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize="small",
        )
    ax.set_xticks(x, [g.label for g in groups], rotation=20, fontsize="small")
    if key == "time_to_target_s":
        ax.set(ylabel="seconds", title="time to target (whiskers: 95% CI over seeds)")
    else:
        ax.set(ylabel="optimizer steps", title="steps to target (convergence per step)")


def plot(groups: list[Group], path: Path) -> None:
    """compare.png: the dashboard, 2×4 panels, a column more where the sweep measured the max
    batch and one where it projected onto a GPU (runner.project)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sized = capacity.measured(groups)  # a column more: the largest batch and sequence
    estimated = projected.shown(groups)  # and one for runner.project's estimates
    columns = 4 + sized + estimated
    fig, axes = plt.subplots(2, columns, figsize=(7 * columns, 9))
    _losses(axes[0][0], groups)
    _gaps(axes[0][1], groups)
    _speed(axes[1][0], groups)
    _memory(axes[1][1], groups)
    eval_against(axes[0][2], groups, "time")
    eval_against(axes[0][3], groups, "tokens")
    time_to_target(axes[1][2], groups)
    time_to_target(axes[1][3], groups, "steps_to_target")
    if sized:
        capacity.panel(axes[0][4], groups, "max_batch")
        capacity.panel(axes[1][4], groups, "max_seq_len")
    if estimated:
        projected.panel(axes[0][-1], groups, "projected_speedup")
        projected.panel(axes[1][-1], groups, "projected_mfu")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
