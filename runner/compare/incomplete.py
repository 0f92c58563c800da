"""The jobs of a sweep that did not complete, each named with why (its summary.json's error, or
the state its launcher recorded: SLURM's CANCELLED, TIMEOUT, ...), and how to complete the
sweep: the same command again, in the same sweep folder."""

from __future__ import annotations

import sys

from runner.compare.jobs import Job


def why(job: Job) -> str:
    return job.summary.get("error") or f"it ended {job.summary.get('status', 'without a summary')}"


def report(jobs: list[Job], sweep_dir: str, resume: str | None, given: bool) -> None:
    """On stderr: each job that did not complete, and how to complete the sweep: the same
    command in the same sweep folder (`given`: the command named it), with trainer.resume=auto
    where the sweep did not set it, so that a stopped job continues from its checkpoint."""
    missing = [j for j in jobs if j.summary.get("status") != "completed"]
    if not missing:
        return
    print(
        f"error: {len(missing)} of {len(jobs)} jobs did not complete; the comparison has the "
        "others and names these:",
        file=sys.stderr,
    )
    for job in missing:
        print(f"  #{job.folder.name} {job.label}: {why(job)}", file=sys.stderr)
    add = [] if given else [f"hydra.sweep.dir={sweep_dir}"]
    add += [] if resume else ["trainer.resume=auto"]
    again = f"the same command{' with ' + ' '.join(add) if add else ''}"
    print(
        f"complete it: run {again} (sweep folder {sweep_dir}): the jobs that completed are "
        "read back, the others run again",
        file=sys.stderr,
    )
