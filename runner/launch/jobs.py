"""A sweep's jobs as its launcher sees them, before and after they run: each job's composed
config, folder and label; a job that completed in the sweep folder before, read back; one that
ended without a result, a failed JobReturn with why, written beside its run (launcher.json) for
the comparison to name. Shared by amp-runner's SLURM and joblib launchers."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf, open_dict

from runner import folders, sweep_folder
from runner.files import write_text
from runner.folders import LAUNCHER_RECORD
from runner.tracking import finished_summary


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
    """One job of the sweep: its number, overrides, composed config (hydra node included),
    folder and label; what the launcher learns of it as it runs."""

    num: int
    overrides: list[str]
    config: DictConfig
    folder: Path | None  # None where only the node knows it (a subdir with ${hydra.job.id})
    label: str
    submitted: Any = None  # the launcher's handle on it (submitit's Job)
    state: str = ""
    reason: str = ""


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def sweep_jobs(launcher, job_overrides: list[list[str]], first: int) -> list[SweepJob]:
    """Each job with its composed config and folder, labelled by what varies between them."""
    varying = [o for o in {o for job in job_overrides for o in job} if len(job_overrides) > 1]
    varying = [o for o in varying if not all(o in job for job in job_overrides)]
    jobs = []
    for num, overrides in enumerate(job_overrides, start=first):
        config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
        with open_dict(config.hydra.job):
            config.hydra.job.num = num
        label = " ".join([f"#{num}", *(o for o in overrides if o in varying)])
        jobs.append(SweepJob(num, overrides, config, folder_of(config), label))
    return jobs


def folder_of(config: DictConfig) -> Path | None:
    """The job's folder, as the node will name it; None where it names it by its SLURM job id."""
    if "hydra.job.id" in str(OmegaConf.to_container(config.hydra.sweep)["subdir"]):
        return None
    try:
        return Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
    except Exception:  # an interpolation only the node resolves
        return None


def read_back(job: SweepJob, quiet: bool = False) -> JobReturn | None:
    """The result of a job that completed in this folder, with these overrides, at its
    max_steps (said, unless `quiet`); None for a job to run."""
    if job.folder is None or not (job.folder / ".hydra" / "overrides.yaml").exists():
        return None
    if list(OmegaConf.load(job.folder / ".hydra" / "overrides.yaml")) != job.overrides:
        return None
    summary = finished_summary(job.folder, job.config.trainer.max_steps)
    if summary is None:
        return None
    sweep_folder.adopt(job.folder, _sweep_of(job))  # a job of this sweep, not run again
    if not quiet:
        say(f"{job.label}: completed before ({job.folder}/summary.json): read back, not run again")
    return JobReturn(
        overrides=job.overrides,
        working_dir=str(job.folder),
        task_name=job.config.hydra.job.name,
        status=JobStatus.COMPLETED,
        _return_value=summary.get("final_loss"),
    )


def unfinished(job: SweepJob, why: str) -> Unfinished:
    """The JobReturn of a job that ended without a result, said on stderr."""
    say(f"{job.label}: {why}")
    return Unfinished(
        overrides=job.overrides,
        working_dir=str(job.folder) if job.folder else None,
        task_name=job.config.hydra.job.name,
        status=JobStatus.FAILED,
        _return_value=RuntimeError(why),
        why=why,
    )


def record(job: SweepJob, launcher: str, state: str, why: str, **more) -> None:
    """launcher.json beside the run: how the launcher saw it end (`state`: COMPLETED, or SLURM's
    CANCELLED, ...; `why`: what the comparison names where the run did not complete). A job
    that never started gets the .hydra/ record Hydra would have written, so that the comparison
    can place it among the others."""
    if job.folder is None:
        return
    hydra_dir = job.folder / ".hydra"
    if not (hydra_dir / "config.yaml").exists():
        hydra_dir.mkdir(parents=True, exist_ok=True)
        task = OmegaConf.masked_copy(job.config, [k for k in job.config if k != "hydra"])
        write_text(hydra_dir / "config.yaml", OmegaConf.to_yaml(task))
        write_text(hydra_dir / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(job.overrides)))
    seen = {"launcher": launcher, "state": state, "why": why, "sweep": _sweep_of(job)}
    write_text(job.folder / LAUNCHER_RECORD, json.dumps(seen | more) + "\n")


def _sweep_of(job: SweepJob) -> str | None:
    """The id of the sweep the job is part of: from its composed config where the launcher
    holds it (the launcher's process has no job config of Hydra's to ask), else Hydra's."""
    if "hydra" in job.config:
        return folders.sweep_id(Path(str(job.config.hydra.sweep.dir)))
    return folders.current_sweep()
