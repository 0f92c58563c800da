"""The jobs of a sweep that did not complete, each named with why (its summary.json's error, or
the state its launcher recorded: SLURM's CANCELLED, TIMEOUT, ...), and how to complete the
sweep: the same command again, in the same sweep folder (runner/run.py continues each job there,
amp-runner's SLURM launcher submits only the jobs that did not complete)."""

from __future__ import annotations

import sys

from runner.compare.jobs import Job


def why(job: Job) -> str:
    return job.summary.get("error") or f"it ended {job.summary.get('status', 'without a summary')}"


def report(jobs: list[Job], sweep_dir: str, given: bool) -> None:
    """On stderr: each job that did not complete, and how to complete the sweep: the same
    command in the same sweep folder (`given`: the command names it), where each job that
    completed is read back and the others continue from their last checkpoint."""
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
    again = "the same command" if given else f"the same command with hydra.sweep.dir={sweep_dir}"
    print(
        f"complete it: run {again}: the jobs that completed are read back, the others continue "
        "from their last checkpoint",
        file=sys.stderr,
    )
