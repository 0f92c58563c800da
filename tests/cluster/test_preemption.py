"""No preemption loses work, on the real one-node SLURM: each way a cluster takes a machine
back, sent to a job of a real `+launcher=slurm` sweep while it trains. The job checkpoints at the
signal (where there is time), is requeued, resumes at that step, and ends with one metrics.jsonl
and one W&B run whose offline files hold every step exactly once."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from runner import wandb_file
from tests.helpers import read_metrics

from .conftest import finish, wait_until

pytestmark = pytest.mark.cluster

STEPS = 400
REPO = Path(__file__).resolve().parents[2]
JOB = [
    "model=mlp",
    "trainer.device=cpu",
    "trainer.progress_bar=false",
    f"trainer.max_steps={STEPS}",
    "trainer.val_check_interval=0",
    "trainer.checkpoint_every_n_steps=100",
    "logger=wandb",
    "hydra.launcher.gpus_per_node=0",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=1",
]


def sweep(slurm, sweep_dir: Path, *overrides: str) -> subprocess.Popen:
    """`python -m runner -m +launcher=slurm ...` as a user starts it, in the background."""
    env = {**slurm.env, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = str(REPO)  # a job imports this file's SlowNet
    log = open(sweep_dir.with_suffix(".log"), "w")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runner",
            "-m",
            "+launcher=slurm",
            *JOB,
            *overrides,
            f"hydra.sweep.dir={sweep_dir}",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=sweep_dir.parent,
    )


def slurm_job(slurm, sweep_dir: Path) -> str:
    """The SLURM id of the sweep's one job: the job submitted from its folder's parent."""

    def submitted():
        listed = slurm.run("squeue", "-h", "-o", "%i %Z").stdout.split("\n")
        return [
            i for i, _, cwd in (x.partition(" ") for x in listed) if cwd == str(sweep_dir.parent)
        ]

    return wait_until(submitted, 60, "the sweep's job in squeue")[0]


def rows(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def job_log(sweep_dir: Path) -> str:
    """What the sweep's jobs printed, over every attempt (submitit's log files)."""
    return "".join(p.read_text() for p in sorted((sweep_dir / ".submitit").glob("*/*_log.*")))


def nothing_lost(run_dir: Path, steps: int = STEPS) -> list[Path]:
    """One metrics.jsonl and one W&B run, each with steps 1..`steps` exactly once; the run's
    W&B files (one per attempt)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == steps
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, steps + 1))
    files = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    run_ids = {p.name.removeprefix("run-").removesuffix(".wandb") for p in files}
    assert len(run_ids) == 1, run_ids
    files = wandb_file.run_files(run_dir, run_ids.pop())
    sent = [row["step"] for path in files for row in wandb_file.history(path) if "loss" in row]
    assert sent == list(range(1, steps + 1))
    return files


@pytest.mark.parametrize(
    "how, command",
    [
        ("SIGTERM", ["scontrol", "requeue"]),  # a requeue, as preemption by a higher priority does
        ("SIGUSR2", ["scancel", "--signal=USR2"]),  # the time-limit signal submitit asks for
        ("SIGUSR1", ["scancel", "--signal=USR1"]),  # a user's own --signal
    ],
)
def test_a_signalled_job_resumes_where_it_stopped(slurm, tmp_path, how, command):
    sweep_dir = tmp_path / "sweep"
    proc = sweep(slurm, sweep_dir, "precision=fp32")
    job, run_dir = slurm_job(slurm, sweep_dir), sweep_dir / "0"
    wait_until(lambda: rows(run_dir) >= 20, 120, "the job trains")
    slurm.run(*command, job)
    out = finish(proc, sweep_dir.with_suffix(".log"))
    assert proc.returncode == 0, out[-3000:]
    log = job_log(sweep_dir)
    stopped = re.findall(rf"preempted by {how} at step (\d+)", log)
    resumed = re.findall(r"resumed from [\s\S]*?at\s+step\s+(\d+)", log)  # wrapped lines
    assert stopped and resumed == stopped[:1], log[-3000:]
    assert 20 <= int(stopped[0]) < STEPS
    assert len(nothing_lost(run_dir)) == 2  # two attempts, one W&B run


def job_process(job: str) -> int:
    """The pid of the Python process training SLURM job `job`."""

    def find():
        for proc in Path("/proc").iterdir():
            try:
                environ = (proc / "environ").read_bytes().split(b"\0")
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if (
                f"SLURM_JOB_ID={job}".encode() in environ
                and b"submitit" in cmdline
                and b"python" in cmdline
            ):
                return int(proc.name)
        return None

    return wait_until(find, 30, f"the process of job {job}")


def test_a_killed_job_resumes_from_its_last_checkpoint_when_the_sweep_is_rerun(slurm, tmp_path):
    """SIGKILL, as a node failure leaves it: no time to checkpoint. The sweep says the job did not
    finish; the same command again resumes it from its last checkpoint, and what the killed
    attempt sent W&B after that checkpoint is not sent twice."""
    sweep_dir = tmp_path / "sweep"
    proc = sweep(slurm, sweep_dir, "precision=fp32")
    job, run_dir = slurm_job(slurm, sweep_dir), sweep_dir / "0"
    wait_until(lambda: rows(run_dir) >= 130, 180, "the job trains past its first checkpoint")
    os.kill(job_process(job), signal.SIGKILL)
    out = finish(proc, sweep_dir.with_suffix(".log"))
    assert proc.returncode != 0, out[-3000:]
    proc = sweep(slurm, sweep_dir, "precision=fp32")
    out = finish(proc, sweep_dir.with_suffix(".log"))
    assert proc.returncode == 0, out[-3000:]
    assert (sweep_dir / "compare.md").exists()
    assert len(nothing_lost(run_dir)) == 2


class SlowNet(nn.Linear):
    """The blobs' classifier, slow whatever the CPU: 200 ms a forward in a job's first attempt
    (600 steps then outlast its 2-minute limit on any machine: it is signalled), no pause after
    a requeue (SLURM_RESTART_COUNT), so the rest ends in the seconds SLURM's early signal leaves
    an attempt on a slow machine (it came 16 s after an attempt's start here)."""

    def __init__(self):
        super().__init__(32, 8)
        self.pause = 0.2 if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" else 0.0

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        time.sleep(self.pause)
        return super().forward(features)


def test_a_run_longer_than_its_time_limit_finishes_across_requeues(slurm, tmp_path):
    """A real time limit (2 minutes) with submitit's signal 30 s before it (SLURM sends it up to
    30 s early: 60-90 s after the start; a 1-minute limit could send it as the job starts), on a
    run whose first attempt cannot finish in it: each attempt checkpoints at the signal and is
    requeued; the run finishes with nothing lost, and no early-signal warning was said."""
    steps = 600
    sweep_dir = tmp_path / "sweep"
    proc = sweep(
        slurm,
        sweep_dir,
        "precision=fp32",
        f"trainer.max_steps={steps}",
        "model=module",
        "model.net._target_=tests.cluster.test_preemption.SlowNet",
        "dataset=blobs",
        "hydra.launcher.timeout_min=2",
        "hydra.launcher.signal_delay_s=30",
        "hydra.launcher.max_num_timeout=12",  # an attempt signalled in its setup counts too
    )
    out = finish(proc, sweep_dir.with_suffix(".log"), timeout=600)
    log = job_log(sweep_dir)
    assert proc.returncode == 0, out[-2000:] + "\njob log:\n" + log[-4000:]
    assert "may come" not in out
    # SLURM's SIGUSR2, or the run's own watch of the job's end where it comes first
    stopped = re.findall(r"preempted by (?:SIGUSR2|the time limit \([^)]*\)) at step (\d+)", log)
    resumed = re.findall(r"resumed from [\s\S]*?at\s+step\s+(\d+)", log)  # wrapped lines
    # each attempt resumes where the one before stopped (one signalled in its setup, on a slow
    # machine, stops where it resumed: no step of its own)
    assert stopped and resumed[0] == stopped[0] and set(resumed) <= set(stopped), log[-3000:]
    assert len(nothing_lost(sweep_dir / "0", steps)) >= 2
