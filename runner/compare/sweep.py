"""`python -m runner.compare SWEEP_DIR`: the precisions of a sweep side by side, with a verdict.

Reads each job folder's summary.json, metrics.jsonl and .hydra/config.yaml; writes compare.md,
compare.csv, compare.json and compare.png into the sweep folder, prints the table, and logs it to
the sweep's W&B group. Also runs by itself at the end of every multirun (`CompareCallback`).
A job is what it ran (jobs.py: its resolved config less its precision mode and seed). Jobs that
differ only by their seed make one row (verdicts.py); rows that differ only in precision.* make
one setting, compared with that setting's fp32 row (or, without fp32, its first row, as the
report notes). Each job is checked against its baseline's job of the same seed (its health, its
loss curve's gap). With runner.speed=interleaved (or --speed interleaved), each setting's rows
are timed again in this process, side by side (interleave.py), and the verdicts use them.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from runner import console, sweep_folder
from runner.compare import capacity, dashboard, finetune, incomplete, report, seeds
from runner.compare.crossing import diverged_evaluation
from runner.compare.groups import Group, closest, completed, memory_figure, scales_loss
from runner.compare.jobs import Job, load_sweep, others_line
from runner.compare.stats import CONFIDENCE, as_float, quartiles
from runner.compare.target import TargetSpec
from runner.compare.verdicts import judge
from runner.config import RunnerConfig
from runner.config.schema import CompareConfig
from runner.errors import UserError, fail
from runner.summary_aliases import converted_share

TOLERANCE = CompareConfig.tolerance  # compare.tolerance's default
MAX_SKIPPED_SHARE = 0.5


def _smoothed(rows: list[dict], window: int) -> dict[int, float]:
    return dashboard.smoothed(
        [r["step"] for r in rows], [as_float(r.get("loss")) for r in rows], window
    )


def baseline(row: Group, peers: list[Group]) -> Group | None:
    """What `row` is compared with, among the completed rows of its setting: the fp32 row that
    shares the most of its precision.* values (fp32 init_scale=1 for fp16 init_scale=1), or where
    the setting has no fp32, its first row (the report says so); None for a row alone."""
    peers = [p for p in peers if completed(p)]
    fp32 = [p for p in peers if p.precision == "fp32"]
    if fp32:
        return closest(row, fp32)
    return peers[0] if len(peers) > 1 else None


def group(jobs: list[Job]) -> list[Group]:
    """The rows of a sweep: jobs that differ only by their seed, each with its baseline."""
    groups: dict[tuple, Group] = {}
    for job in jobs:
        row = groups.setdefault((job.precision, job.identity), Group([], job.label))
        seed = job.config.get("seed")
        twin = next(
            (j for j in row.jobs if seed is not None and j.config.get("seed") == seed), None
        )
        if twin is not None:  # the same run again (another command's job folder): one seed
            console.say(
                f"{job.folder.name}: the same config and seed as {twin.folder.name}: "
                "counted once, not as another seed"
            )
            continue
        row.jobs.append(job)
    rows = list(groups.values())
    for g in rows:
        g.base = baseline(g, [r for r in rows if r.setting == g.setting])
    return rows


def _speed_quartiles(job: Job) -> tuple[float, float]:
    """The quartiles of its steady window's per-step samples/s (runner/train/telemetry.py's: the
    steps after trainer.benchmark.warmup_steps), where they give summary.json's
    samples_per_s_iqr (a resumed run's window is not its record's); else NaN."""
    iqr = as_float(job.summary.get("samples_per_s_iqr"))
    if not math.isfinite(iqr) or not job.rows:
        return math.nan, math.nan
    warmup = job.config.get("trainer", {}).get("benchmark", {}).get("warmup_steps", 10)
    start = job.rows[0]["step"] - 1 + warmup
    q1, q3 = quartiles(as_float(r.get("samples_per_s")) for r in job.rows if r["step"] > start)
    return (q1, q3) if math.isclose(q3 - q1, iqr, rel_tol=1e-6, abs_tol=1e-9) else (math.nan,) * 2


def _job_figures(job: Job, base: Job | None) -> None:
    """A job's own figures and health, and those paired with its baseline's job of the same
    seed (speedup, memory saving, loss-curve gaps)."""
    s = job.summary
    steps = s.get("steps") or len(job.rows)
    final_loss = as_float(s.get("final_loss"))
    skipped = s.get("skipped_steps") or 0
    f = job.figures = {
        "samples_per_s": as_float(s.get("samples_per_s")),
        "samples_per_s_iqr": as_float(s.get("samples_per_s_iqr")),
        **dict(zip(("samples_per_s_q1", "samples_per_s_q3"), _speed_quartiles(job), strict=True)),
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
        "converted_flop_share": as_float(converted_share(s)),
        **capacity.job_figures(s),
        **finetune.job_figures(s),
    }
    f |= dict.fromkeys(("speedup", "memory_saving", "max_loss_gap", "final_loss_gap"), math.nan)
    if base is not None and base is not job:
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
        if last is not None and theirs[last]:
            f["final_loss_gap"] = (ours[last] - theirs[last]) / abs(theirs[last])
    elif base is job:
        f |= {"speedup": 1.0, "memory_saving": 0.0, "max_loss_gap": 0.0, "final_loss_gap": 0.0}
    if s.get("status") != "completed":
        f["health"] = "failed"
        job.verdict = f"failed: {s.get('error', s.get('status'))}"
    elif not math.isfinite(final_loss) or any(
        not math.isfinite(as_float(r.get("loss"))) for r in job.rows
    ):
        f["health"] = "diverged"
        job.verdict = "diverged: the loss became inf/NaN — not recommended"
    elif bad := diverged_evaluation(job):
        f["health"] = "diverged"
        job.verdict = f"diverged: its {bad} — not recommended"
    elif steps and skipped / steps > MAX_SKIPPED_SHARE:
        # fp16 skips on overflow by design; elsewhere a skip means a non-finite gradient.
        f["health"] = "overflow" if scales_loss(job.precision) else "diverged"
        what = "overflowed" if scales_loss(job.precision) else "diverged"
        job.verdict = f"{what}: {skipped} of {steps} steps skipped — not recommended"
    else:
        f["health"] = "ok"


def analyse(
    groups: list[Group],
    tolerance: float = TOLERANCE,
    timings: dict | None = None,
    spec: TargetSpec | None = None,
    level: float = CONFIDENCE,
    first: frozenset | None = None,
) -> list[Group]:
    """Fill each job's figures (against its row's baseline job of the same seed) and health,
    then each row's figures and verdict (runner/compare/verdicts.py: a loss within `tolerance` of the
    baseline's is the same convergence; the speed from `timings` where given, by row identity,
    see runner/compare/interleave.py; every interval at confidence `level`; `first`: a
    runner.seeds=auto sweep's first look's seeds, runner/compare/seeds.py)."""
    for g in groups:
        for job in g.jobs:
            seed = job.config.get("seed")
            twins = (
                j
                for j in (g.base.jobs if g.base else [])
                if j.config.get("seed") == seed and j.summary.get("status") == "completed"
            )
            _job_figures(job, job if g.base is g else next(twins, None))
    judge(groups, tolerance, timings, spec, level, first)
    return groups


def _settings(jobs: list[Job], given: dict | None = None) -> RunnerConfig:
    """The sweep's runner block: the command's (`given`, a rerun's runner.max_seeds included),
    else its first job's that has one; defaults for missing keys."""
    block = given or next((j.config["runner"] for j in jobs if j.config.get("runner")), {})
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunnerConfig), block))


def _target(jobs: list[Job], given: dict | None) -> tuple[TargetSpec, float]:
    """The target and the tolerance: the sweep's compare block (from its first job that has
    one), `given`'s keys (target, target_metric, target_direction, tolerance: the command
    line's) over it."""
    block = next((j.config["compare"] for j in jobs if j.config.get("compare")), {})
    block = {k: v for k, v in block.items() if k.startswith("target") or k == "tolerance"}
    block |= {k: v for k, v in (given or {}).items() if v is not None}
    spec = TargetSpec(
        value=block.get("target"),
        metric=block.get("target_metric") or "eval_loss",
        direction=block.get("target_direction"),
    )
    return spec, block.get("tolerance", TOLERANCE)


def compare(
    sweep_dir: Path,
    tolerance: float | None = None,
    wandb_log: bool = True,
    speed: str | None = None,
    target: dict | None = None,
    look: set[int] | None = None,
    runner: dict | None = None,
) -> list[Group]:
    """The comparison of a sweep, written, shown and logged: one group per row. `speed`: jobs
    or interleaved; None: as the sweep's runner.speed says. `target`: compare.target,
    target_metric, target_direction over the sweep's own (runner/compare/target.py);
    `tolerance`: over its compare.tolerance. `look`: the later rounds this process ran, where
    this is a look of a runner.seeds=auto sweep, which, where a round follows, is written and
    said in a line a row, not shown or logged (runner/compare/seeds.py); `runner`: the
    command's runner block, over the one its jobs recorded."""
    jobs = load_sweep(sweep_dir)
    settings = _settings(jobs, runner)
    spec, tolerance = _target(jobs, (target or {}) | {"tolerance": tolerance})
    groups = group(jobs)
    timings = None
    if (speed or settings.speed) == "interleaved":
        timings = seeds.timings(groups, settings, sweep_dir, look)
    level, first = seeds.level(settings, groups), seeds.first_look(jobs, settings)
    analyse(groups, tolerance, timings, spec, level, first)
    seeds.stopped(groups, settings)
    paths = report.write(groups, sweep_dir)
    if look is not None and seeds.next_round(groups, look) is not None:
        for g in groups:
            console.say(
                f"seeds=auto: {g.label} ({len(g.jobs)} seeds): {g.figures['seeds_stopped']}"
            )
        return groups
    report.show(groups, sweep_dir, paths)
    if others := others_line(sweep_dir):
        console.say(others)
    if wandb_log:
        report.log_to_wandb(groups, sweep_dir, paths)
    return groups


class CompareCallback(Callback):
    """Runs the comparison when a multirun ends; a failed job makes the command exit non-zero."""

    failed_jobs = 0
    refused = False  # a job was refused its folder (runner/folders.py): the command exits 2
    next_round: tuple | None = None  # runner.seeds=auto: (seed, its blocks, the sweep folder)
    ran: set[int] = set()  # the later rounds' seeds this process ran (runner/__main__.py)
    deferred = False  # a round's block that another follows: the look waits for the last

    def on_multirun_start(self, config, **kwargs) -> None:
        """The sweep folder taken for this command (runner/folders.py): refused in one line,
        exit 2, where another command writes it or its jobs' folders hold other runs."""
        from runner.train.distributed import from_env

        if not from_env().main:
            return
        params = OmegaConf.to_container(config.hydra.sweeper, resolve=False).get("params") or {}
        command = [f"{k}={v}" for k, v in params.items()]  # as Hydra's basic sweeper orders them
        command += OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
        subdir = OmegaConf.to_container(config.hydra.sweep)["subdir"]
        try:
            sweep_folder.start_sweep(Path(config.hydra.sweep.dir), command, str(subdir))
        except UserError as e:
            fail(e)

    def on_multirun_end(self, config, **kwargs) -> None:
        from runner.train.distributed import from_env
        from runner.train.preemption import between_jobs

        if not from_env().main or CompareCallback.deferred:  # under torchrun, rank 0 compares
            return
        if config.runner.seeds == "auto":  # a signal at its look stops it before the next round
            between_jobs()
        sweep = Path(config.hydra.sweep.dir)
        for line in sweep_folder.refusals(sweep):
            print(f"error: {line}", file=sys.stderr)
            CompareCallback.refused = True
        try:
            jobs = load_sweep(sweep)
            CompareCallback.failed_jobs = sum(j.summary.get("status") != "completed" for j in jobs)
            given = OmegaConf.to_container(config.compare) if config.get("compare") else None
            ran = CompareCallback.ran if config.runner.seeds == "auto" else None
            runner = OmegaConf.to_container(config.runner, resolve=True)
            groups = compare(sweep, speed=runner["speed"], target=given, look=ran, runner=runner)
            following = ran is not None and seeds.next_round(groups, ran)
            CompareCallback.next_round = following and (*following, str(sweep.absolute()))
            if following:
                return
        except UserError as e:  # the failed jobs still fail the command
            print(f"error: {e}", file=sys.stderr)
        else:
            named = any(o.startswith("hydra.sweep.dir=") for o in config.hydra.overrides.hydra)
            incomplete.report(jobs, str(sweep), named)
