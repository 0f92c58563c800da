"""A sweep's jobs on SLURM, every one accounted for (`+launcher=slurm`, through
hydra_plugins/amp_runner_launcher): the request checked against the partition before anything is
submitted; a job that completed in this sweep folder before (its summary.json, at its
max_steps) read back, not submitted again; while the sweep waits, a pending job's reason from the
queue; a job that ends TIMEOUT or PREEMPTED with a checkpoint (its own requeue came too late)
submitted again, up to hydra.launcher.max_num_timeout times; and each job that ends without a
result (cancelled, failed, timed out, lost) returned as a failed job with SLURM's state, written
beside its run (launcher.json), so that the comparison at the end names it and the command
fails. Hydra's own launcher waits on the first job that fails
and raises, and the comparison never runs."""

from __future__ import annotations

import time
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from runner.errors import UserError, fail, first_line
from runner.launch import slurm
from runner.launch.jobs import SweepJob, read_back, record, say, sweep_jobs, unfinished

POLL_S = 3.0  # how often the queue is asked while the sweep waits
# Ended with the run unfinished but resumable: its checkpoint continues it (trainer.resume=auto)
RESUBMIT_STATES = ("TIMEOUT", "PREEMPTED")


def launch(launcher, job_overrides, initial_job_idx: int) -> list[JobReturn]:
    """What Hydra's launch() returns, one JobReturn per job, in order; waits for every job."""
    try:
        slurm.check_request(launcher.params)
    except UserError as e:
        fail(e)
    except slurm.SlurmError as e:
        fail(UserError(f"cannot submit to SLURM: {e}"))
    if early := slurm.early_signal(launcher.params):
        say(early)
    no_accounting = slurm.accounting()
    if no_accounting:
        say(
            f"warning: SLURM accounting does not answer ({no_accounting}): a job that ends "
            "without a result is reported with the last state the queue showed"
        )
    jobs = sweep_jobs(launcher, [list(o) for o in job_overrides], initial_job_idx)
    returns = {j.num: done for j in jobs if (done := read_back(j)) is not None}
    todo = [j for j in jobs if j.num not in returns]
    resubmitted: dict[int, int] = {}
    batch = todo
    while batch:
        _submit(launcher, batch)
        _wait(batch)
        _final_states([j for j in batch if not _has_result(j)])
        limit = launcher.params.get("max_num_timeout") or 0
        batch = [j for j in batch if _resubmit(j, resubmitted, limit)]
    returns |= {j.num: _outcome(j) for j in todo}
    return [returns[j.num] for j in jobs]


def _resubmit(job: SweepJob, resubmitted: dict[int, int], limit: int) -> bool:
    """Whether `job` goes again: it ended TIMEOUT or PREEMPTED (its requeue did not come in
    time, or SLURM does not requeue) with a checkpoint to resume from, fewer than `limit` times
    (hydra.launcher.max_num_timeout) so far. Said, with the count."""
    if _has_result(job) or job.state not in RESUBMIT_STATES or job.folder is None:
        return False
    checkpoints = job.folder / "checkpoints"
    if not (checkpoints.is_dir() and any(checkpoints.iterdir())):
        return False
    count = resubmitted.get(job.num, 0) + 1
    if count > limit:
        return False
    resubmitted[job.num] = count
    say(
        f"{job.label}: SLURM job {job.submitted.job_id} {job.state} with a checkpoint: "
        f"submitted again ({count} of hydra.launcher.max_num_timeout={limit})"
    )
    job.state = job.reason = ""
    return True


def _submit(launcher, jobs: list[SweepJob]) -> None:
    """One SLURM array of `jobs`, with the launcher's parameters (as Hydra's own launcher
    passes them to submitit); each job's submitit Job set."""
    import submitit
    from hydra.core.singleton import Singleton
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    params = dict(launcher.params)
    executor = submitit.AutoExecutor(
        cluster="slurm",
        folder=params.pop("submitit_folder"),
        slurm_max_num_timeout=params.pop("max_num_timeout"),
    )
    generic = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(
        **{k if k in generic else f"slurm_{k}": v for k, v in params.items()}
    )
    Path(str(launcher.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    state = Singleton.get_state()
    # The arguments of the launcher's __call__, which runs each job on its node: one list each.
    calls = (
        [j.overrides for j in jobs],
        ["hydra.sweep.dir"] * len(jobs),
        [j.num for j in jobs],
        [f"job_id_for_{j.num}" for j in jobs],
        [state] * len(jobs),
    )
    for job, submitted in zip(jobs, executor.map_array(launcher, *calls), strict=True):
        job.submitted = submitted
        say(f"{job.label}: SLURM job {submitted.job_id}")


def _wait(jobs: list[SweepJob]) -> None:
    """Until every job has left the queue (or ended in it: twice seen ended, as a requeued job
    passes through an ended state on its way back to PENDING). A pending job's reason is said
    each time it changes."""
    running = {j.submitted.job_id: j for j in jobs}
    seen_ended: dict[str, int] = {}
    failed_query = ""
    while running:
        try:
            held = slurm.queue(list(running))
        except slurm.SlurmError as e:  # the controller away for a moment: ask again
            if str(e) != failed_query:
                say(f"warning: {e}; asking again every {POLL_S:.0f} s")
            failed_query = str(e)
            time.sleep(POLL_S)
            continue
        failed_query = ""
        for job_id, job in list(running.items()):
            state, reason = held.get(job_id, ("", ""))
            if state:
                job.state = state
            if state and state not in slurm.ENDED:
                seen_ended.pop(job_id, None)
                if state == "PENDING" and reason not in ("None", job.reason):
                    say(f"{job.label}: SLURM job {job_id} pending ({reason})")
                job.reason = reason if state == "PENDING" else ""
                continue
            seen_ended[job_id] = seen_ended.get(job_id, 0) + 1
            if not state or seen_ended[job_id] >= 2 or _has_result(job):
                del running[job_id]
        if running:
            time.sleep(POLL_S)


def _has_result(job: SweepJob) -> bool:
    tasks = [job.submitted.task(i) for i in range(job.submitted.num_tasks)]
    return all(t.paths.result_pickle.exists() for t in tasks)


def _final_states(jobs: list[SweepJob], patience_s: float = 15.0) -> None:
    """Each job's state as accounting records it (it lags the queue by a moment); where it does
    not answer, the last state the queue showed (CANCELLED where that was PENDING), or LOST."""
    if not jobs:
        return
    deadline = time.monotonic() + patience_s
    while True:
        found = slurm.states([j.submitted.job_id for j in jobs])
        if all(found.get(j.submitted.job_id) in slurm.ENDED for j in jobs):
            break
        if not found or time.monotonic() > deadline:
            break
        time.sleep(1)
    for job in jobs:
        state = found.get(job.submitted.job_id)
        if not state and job.state == "PENDING":
            # A task of an array none of whose tasks has started yet, cancelled, leaves the
            # queue at once, without a CANCELLED state there or a record in accounting.
            state = "CANCELLED"
        job.state = state or job.state or "LOST"


def _outcome(job: SweepJob) -> JobReturn:
    """The job's own JobReturn where it ended with one that completed; else an Unfinished one."""
    job_id = job.submitted.job_id
    why = f"SLURM job {job_id} {job.state}"
    if _has_result(job):
        try:
            ret = job.submitted.results()[0]
            if ret.status == JobStatus.COMPLETED:
                record(job, "slurm", "COMPLETED", f"SLURM job {job_id} COMPLETED", job_id=job_id)
                return ret
            why += f": {first_line(ret._return_value)}"
        except Exception as e:
            why += f": {first_line(e)}"
    record(job, "slurm", job.state, why, job_id=job_id)
    return unfinished(job, why)
