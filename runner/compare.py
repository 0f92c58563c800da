"""`python -m runner.compare SWEEP_DIR`: the precisions of a sweep side by side, with a verdict.

Reads each job folder's summary.json, metrics.jsonl and .hydra/config.yaml; writes compare.md,
compare.csv, compare.json and compare.png into the sweep folder, prints the table, and logs it to
the sweep's W&B group. Also runs by itself at the end of every multirun (`CompareCallback`).
Each job is checked against the fp32 job of the same overrides and seed (its health, its loss
curve's gap); jobs that differ only by their seed make one row (runner/seeds.py). With
runner.speed=interleaved (or --speed interleaved), each setting's precisions are timed again in
this process, side by side (runner/interleave.py), and the verdicts use those figures.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from runner import report
from runner.config import LOSS_SCALED_MODES, RunnerConfig
from runner.errors import UserError
from runner.report import as_float
from runner.seeds import Group, judge, memory_figure

TOLERANCE = 0.02  # a loss within 2% of fp32's counts as "the same convergence" (one seed)
MAX_SKIPPED_SHARE = 0.5


@dataclass
class Job:
    folder: Path
    summary: dict
    rows: list[dict]
    config: dict
    overrides: list[str]
    verdict: str = ""  # why it failed, diverged or overflowed; its group's verdict says the rest
    figures: dict = field(default_factory=dict)

    @property
    def precision(self) -> str:
        return self.summary.get("precision") or self.config.get("precision", {}).get("mode", "?")

    @property
    def context(self) -> tuple:
        """What must match for two jobs to be compared: every override but the precision."""
        return tuple(sorted(o for o in self.overrides if not o.startswith("precision")))

    @property
    def setting(self) -> tuple:
        """Its context but the seed: what the seeds of one group share."""
        return tuple(o for o in self.context if o.partition("=")[0] != "seed")


def _read_job(folder: Path) -> Job:
    summary_file, metrics_file = folder / "summary.json", folder / "metrics.jsonl"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    if not summary:
        summary = {
            "status": "failed",
            "error": "no summary.json: the job was killed or never started",
        }
    rows = []
    if metrics_file.exists():
        rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    hydra_dir = folder / ".hydra"
    config = (
        OmegaConf.to_container(OmegaConf.load(hydra_dir / "config.yaml"))
        if (hydra_dir / "config.yaml").exists()
        else {}
    )
    overrides = (
        list(OmegaConf.load(hydra_dir / "overrides.yaml"))
        if (hydra_dir / "overrides.yaml").exists()
        else []
    )
    return Job(folder, summary, rows, config, overrides)


def load_sweep(sweep_dir: Path) -> list[Job]:
    if not sweep_dir.is_dir():
        raise UserError(f"compare: {sweep_dir} is not a folder")
    folders = sorted(
        (
            p
            for p in sweep_dir.iterdir()
            if p.is_dir() and ((p / ".hydra").is_dir() or (p / "summary.json").exists())
        ),
        key=lambda p: (len(p.name), p.name),
    )
    if not folders:
        raise UserError(
            f"compare: no runs in {sweep_dir} (expected job folders with .hydra/ or summary.json)"
        )
    jobs = [_read_job(f) for f in folders]
    models = {
        json.dumps(j.config.get("model"), sort_keys=True) for j in jobs if j.config.get("model")
    }
    if len(models) > 1:
        names = sorted(
            {
                str(j.config["model"].get("_target_", "?")).rsplit(".", 1)[-1]
                for j in jobs
                if j.config.get("model")
            }
        )
        raise UserError(
            f"compare: {sweep_dir} mixes runs of different models ({', '.join(names)} or different "
            "sizes); compare one model at a time"
        )
    return jobs


def _smoothed(rows: list[dict], window: int) -> dict[int, float]:
    return report.smoothed(
        [r["step"] for r in rows], [as_float(r.get("loss")) for r in rows], window
    )


def _label(job: Job, keys: set[str]) -> str:
    """Its group's name: the precision and the values of `keys` it overrides ("bf16 lr=1e-3")."""
    values = [
        f"{k.rsplit('.', 1)[-1]}={v}"
        for k, _, v in (o.partition("=") for o in job.context)
        if k in keys
    ]
    return " ".join([job.precision, *values])


def analyse(
    jobs: list[Job], tolerance: float = TOLERANCE, timings: dict | None = None
) -> list[Group]:
    """Fill each job's figures (vs the fp32 job of the same context) and health; return the
    groups of jobs that differ only by their seed, with their figures and verdicts (a loss
    within `tolerance` of fp32's is the same convergence where seed noise is untested; the
    speed from `timings` where given, see runner/interleave.py)."""
    baselines = {
        j.context: j
        for j in jobs
        if j.precision == "fp32" and j.summary.get("status") == "completed"
    }
    values: dict[str, set[str]] = {}
    for job in jobs:
        for key, _, value in (o.partition("=") for o in job.context):
            values.setdefault(key, set()).add(value)
    varying = {key for key, seen in values.items() if len(seen) > 1 and key != "seed"}
    groups: dict[tuple, Group] = {}
    for job in jobs:
        s = job.summary
        key = (job.precision, job.setting)
        groups.setdefault(key, Group([], _label(job, varying))).jobs.append(job)
        steps = s.get("steps") or len(job.rows)
        final_loss = as_float(s.get("final_loss"))
        skipped = s.get("skipped_steps") or 0
        f = job.figures = {
            "samples_per_s": as_float(s.get("samples_per_s")),
            "samples_per_s_iqr": as_float(s.get("samples_per_s_iqr")),
            "step_time_s": as_float(s.get("step_time_s")),
            "flops_per_step": as_float(s.get("flops_per_step")),
            "peak_tflops": as_float(s.get("peak_tflops")),
            "peak_memory_mb": as_float(s.get("peak_memory_mb")),
            "memory_mb": memory_figure(s)[0],
            "final_loss": final_loss,
            "eval_loss": as_float(s.get("eval_loss")),
            "skipped_steps": skipped,
            "steps": steps,
            "final_loss_scale": as_float(s.get("final_loss_scale")),
            "mfu": as_float(s.get("mfu")),
            "low_precision_flop_share": as_float(s.get("low_precision_flop_share")),
        }
        base = baselines.get(job.context)
        if base is not None:
            b = base.summary
            f["speedup"] = f["samples_per_s"] / as_float(b.get("samples_per_s"))
            f["memory_saving"] = 1 - f["memory_mb"] / memory_figure(b)[0]
            window = max(1, min(len(job.rows), len(base.rows)) // 10)
            ours, theirs = _smoothed(job.rows, window), _smoothed(base.rows, window)
            gaps = [
                abs(ours[k] - theirs[k]) / abs(theirs[k])
                for k in ours.keys() & theirs.keys()
                if theirs[k]
            ]
            f["max_loss_gap"] = max(gaps) if gaps else math.nan
            last = max(ours.keys() & theirs.keys(), default=None)
            f["final_loss_gap"] = (
                (ours[last] - theirs[last]) / abs(theirs[last]) if last else math.nan
            )
        if s.get("status") != "completed":
            f["health"] = "failed"
            job.verdict = f"failed: {s.get('error', s.get('status'))}"
        elif not math.isfinite(final_loss) or any(
            not math.isfinite(as_float(r.get("loss"))) for r in job.rows
        ):
            f["health"] = "diverged"
            job.verdict = "diverged: the loss became inf/NaN — not recommended"
        elif steps and skipped / steps > MAX_SKIPPED_SHARE:
            # fp16 skips on overflow by design; elsewhere a skip means a non-finite gradient.
            f["health"] = "overflow" if job.precision in LOSS_SCALED_MODES else "diverged"
            what = "overflowed" if job.precision in LOSS_SCALED_MODES else "diverged"
            job.verdict = f"{what}: {skipped} of {steps} steps skipped — not recommended"
        else:
            f["health"] = "ok"
    judge(list(groups.values()), tolerance, timings)
    return list(groups.values())


def _settings(jobs: list[Job]) -> RunnerConfig:
    """The sweep's runner block (from its first job that has one), defaults for missing keys."""
    block = next((j.config["runner"] for j in jobs if j.config.get("runner")), {})
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunnerConfig), block))


def compare(
    sweep_dir: Path,
    tolerance: float = TOLERANCE,
    wandb_log: bool = True,
    speed: str | None = None,
) -> list[Group]:
    """The comparison of a sweep, written, shown and logged: one group per row. `speed`: jobs
    or interleaved; None: as the sweep's runner.speed says."""
    jobs = load_sweep(sweep_dir)
    settings = _settings(jobs)
    timings = None
    if (speed or settings.speed) == "interleaved":
        from runner.interleave import time_sweep  # torch: only when it times

        timings = time_sweep(jobs, settings)
    groups = analyse(jobs, tolerance, timings)
    paths = report.write(groups, sweep_dir)
    report.show(groups, sweep_dir, paths)
    if wandb_log:
        report.log_to_wandb(groups, sweep_dir, paths)
    return groups


class CompareCallback(Callback):
    """Runs the comparison when a multirun ends; a failed job makes the command exit non-zero."""

    failed_jobs = 0

    def on_multirun_end(self, config, **kwargs) -> None:
        from runner.distributed import from_env

        if not from_env().main:  # under torchrun, rank 0 compares
            return
        try:
            groups = compare(Path(config.hydra.sweep.dir), speed=config.runner.speed)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return
        CompareCallback.failed_jobs = sum(
            j.summary.get("status") != "completed" for g in groups for j in g.jobs
        )


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m runner.compare", description=__doc__.splitlines()[0]
    )
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument(
        "--tolerance", type=float, default=TOLERANCE, help="loss gap vs fp32 still counted as equal"
    )
    parser.add_argument("--no-wandb", action="store_true", help="do not log the comparison to W&B")
    parser.add_argument(
        "--speed",
        choices=("jobs", "interleaved"),
        help="each job's own speed, or the precisions timed again side by side in this process "
        "(default: as the sweep's runner.speed says)",
    )
    args = parser.parse_args(argv)
    try:
        compare(args.sweep_dir, args.tolerance, wandb_log=not args.no_wandb, speed=args.speed)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
