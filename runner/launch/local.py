"""A joblib sweep whose worker dies (killed, out of memory): joblib ends the whole Parallel call
with TerminatedWorkerError, and Hydra's launcher with it, so the comparison never runs. Here
each job that had completed is read back from its folder, each other one is a failed job named
with the worker's death, and the sweep goes on to its comparison (and a non-zero exit)."""

from __future__ import annotations

from hydra.core.utils import JobReturn

from runner.launch.jobs import read_back, record, say, sweep_jobs, unfinished


def after_dead_worker(launcher, job_overrides, initial_job_idx: int, error: Exception) -> list:
    """One JobReturn per job, in order, after `error` ended joblib's Parallel call."""
    say(f"error: a joblib worker died, and joblib stopped the others ({type(error).__name__})")
    jobs = sweep_jobs(launcher, [list(o) for o in job_overrides], initial_job_idx)
    returns: list[JobReturn] = []
    for job in jobs:
        done = read_back(job, quiet=True)
        if done is None:
            why = (
                "stopped: a joblib worker died (killed, or out of memory) and joblib stops them all"
            )
            record(job, "joblib", "KILLED", why)
            done = unfinished(job, why)
        returns.append(done)
    return returns
