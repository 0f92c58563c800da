"""A sweep's jobs on SLURM, every one accounted for (`+launcher=slurm`, through
hydra_plugins/amp_runner_launcher): the request checked against the partition before anything is
submitted; a job that completed in this sweep folder before (its summary.json, at its
max_steps) read back, not submitted again; while the sweep waits, a pending job's reason from the
queue; and each job that ends without a result (cancelled, failed, timed out, lost) returned as
a failed job with SLURM's state, written beside its run (slurm.json), so that the comparison at
the end names it and the command fails. Hydra's own launcher waits on the first job that fails
and raises, and the comparison never runs."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf, open_dict

from runner.compare.jobs import LAUNCHER_RECORD
from runner.errors import UserError, fail, first_line
from runner.launch import slurm
from runner.tracking import finished_summary

POLL_S = 3.0  # how often the queue is asked while the sweep waits


@dataclass
class Unfinished(JobReturn):
    """A job that ended without its result: FAILED, with why. Its value reads as None, not as
    the exception: Hydra's sweeper reads every job's value, and an exception there would end the
    sweep before its comparison, which names this job."""

    why: str = ""

    @property
    def return_value(self) -> None:
        return None


@dataclass
class SweepJob:
    num: int
    overrides: list[str]
    config: DictConfig
    folder: Path | None  # None where only the node knows it (a subdir with ${hydra.job.id})
    label: str
    submitted: Any = None  # submitit's Job
    state: str = ""
    reason: str = ""


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def launch(launcher, job_overrides, initial_job_idx: int) -> list[JobReturn]:
    """What Hydra's launch() returns, one JobReturn per job, in order; waits for every job."""
    try:
        slurm.check_request(launcher.params)
    except UserError as e:
        fail(e)
    except slurm.SlurmError as e:
        fail(UserError(f"cannot submit to SLURM: {e}"))
    no_accounting = slurm.accounting()
    if no_accounting:
        say(
            f"warning: SLURM accounting does not answer ({no_accounting}): a job that ends "
            "without a result is reported with the last state the queue showed"
        )
    jobs = _jobs(launcher, [list(o) for o in job_overrides], initial_job_idx)
    returns = {j.num: done for j in jobs if (done := _read_back(j)) is not None}
    todo = [j for j in jobs if j.num not in returns]
    if todo:
        _submit(launcher, todo)
        _wait(todo)
        _final_states([j for j in todo if not _has_result(j)])
        returns |= {j.num: _outcome(j) for j in todo}
    return [returns[j.num] for j in jobs]


def _jobs(launcher, job_overrides: list[list[str]], first: int) -> list[SweepJob]:
    """Each job with its composed config and folder, labelled by what varies between them."""
    varying = [o for o in {o for job in job_overrides for o in job} if len(job_overrides) > 1]
    varying = [o for o in varying if not all(o in job for job in job_overrides)]
    jobs = []
    for num, overrides in enumerate(job_overrides, start=first):
        config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
        with open_dict(config.hydra.job):
            config.hydra.job.num = num
        label = " ".join([f"#{num}", *(o for o in overrides if o in varying)])
        jobs.append(SweepJob(num, overrides, config, _folder(config), label))
    return jobs


def _folder(config: DictConfig) -> Path | None:
    """The job's folder, as the node will name it; None where it names it by its SLURM job id."""
    if "hydra.job.id" in str(OmegaConf.to_container(config.hydra.sweep)["subdir"]):
        return None
    try:
        return Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
    except Exception:  # an interpolation only the node resolves
        return None


def _read_back(job: SweepJob) -> JobReturn | None:
    """The result of a job that completed in this folder before, with these overrides, at its
    max_steps; None for a job to run."""
    if job.folder is None or not (job.folder / ".hydra" / "overrides.yaml").exists():
        return None
    if list(OmegaConf.load(job.folder / ".hydra" / "overrides.yaml")) != job.overrides:
        return None
    summary = finished_summary(job.folder, job.config.trainer.max_steps)
    if summary is None:
        return None
    say(f"{job.label}: completed before ({job.folder}/summary.json): read back, not submitted")
    return JobReturn(
        overrides=job.overrides,
        working_dir=str(job.folder),
        task_name=job.config.hydra.job.name,
        status=JobStatus.COMPLETED,
        _return_value=summary.get("final_loss"),
    )


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
    not answer, the last state the queue showed, or LOST."""
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
        job.state = found.get(job.submitted.job_id) or job.state or "LOST"


def _outcome(job: SweepJob) -> JobReturn:
    """The job's own JobReturn where it ended with one that completed; else an Unfinished one."""
    job_id = job.submitted.job_id
    why = f"SLURM job {job_id} {job.state}"
    if _has_result(job):
        try:
            ret = job.submitted.results()[0]
            if ret.status == JobStatus.COMPLETED:
                job.state = "COMPLETED"
                _record(job)
                return ret
            why += f": {first_line(ret._return_value)}"
        except Exception as e:
            why += f": {first_line(e)}"
    say(f"{job.label}: {why}")
    _record(job)
    return Unfinished(
        overrides=job.overrides,
        working_dir=str(job.folder) if job.folder else None,
        task_name=job.config.hydra.job.name,
        status=JobStatus.FAILED,
        _return_value=RuntimeError(why),
        why=why,
    )


def _record(job: SweepJob) -> None:
    """slurm.json beside the run: its SLURM job and state, which the comparison names where the
    run did not complete. A job that never started gets the .hydra/ record Hydra would have
    written, so that the comparison can place it."""
    if job.folder is None:
        return
    hydra_dir = job.folder / ".hydra"
    if not (hydra_dir / "config.yaml").exists():
        hydra_dir.mkdir(parents=True, exist_ok=True)
        task = OmegaConf.masked_copy(job.config, [k for k in job.config if k != "hydra"])
        (hydra_dir / "config.yaml").write_text(OmegaConf.to_yaml(task))
        (hydra_dir / "overrides.yaml").write_text(
            OmegaConf.to_yaml(OmegaConf.create(job.overrides))
        )
    record = {"job_id": job.submitted.job_id, "state": job.state}
    (job.folder / LAUNCHER_RECORD).write_text(json.dumps(record) + "\n")
