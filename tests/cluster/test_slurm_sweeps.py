"""`+launcher=slurm` sweeps on the real one-node SLURM (2 CPUs, no GPU), submitted from this
process, which sees no GPU either: the launcher's defaults submit and train; a request the
partition cannot meet is one line before anything is submitted; a job cancelled mid-sweep, or a
DDP job one of whose ranks is killed, is a named failed row of the comparison, and the same
command again completes the sweep without submitting the finished job again."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import cli, read_metrics

from .conftest import finish, wait_until

pytestmark = pytest.mark.cluster

SMALL = ["hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1"]  # two jobs at once
# Long enough to be stopped mid-run (a step takes about 2 ms), with checkpoints to resume from.
LONG = [
    "trainer.max_steps=2000",
    "trainer.checkpoint_every_n_steps=100",
    "trainer.val_check_interval=0",
]


@pytest.fixture
def name(slurm) -> Iterator[str]:
    """The sweep's SLURM job name, its own: what a failed test leaves queued is cancelled."""
    name = f"amp-test-{uuid.uuid4().hex[:8]}"
    yield name
    slurm.run("scancel", "-n", name, check=False)


def command(
    sweep_dir: Path, name: str, *overrides: str, launcher: str = "+launcher=slurm"
) -> list[str]:
    return [
        "-m",
        launcher,
        f"hydra.launcher.name={name}",
        "model=mlp",
        "trainer.progress_bar=false",
        "hydra.launcher.gpus_per_node=0",  # the partition has no GPU: refused otherwise
        *overrides,
        f"hydra.sweep.dir={sweep_dir}",
    ]


def environment(slurm) -> dict[str, str]:
    return {**slurm.env, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def start(slurm, args: list[str], log: Path) -> subprocess.Popen:
    """The sweep in the background, as a user starts it; its output into `log`."""
    return subprocess.Popen(
        [sys.executable, "-m", "runner", *args],
        env=environment(slurm),
        cwd=log.parent,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def submissions(out: str) -> dict[int, str]:
    """Job number → the SLURM job id it was submitted as, as the sweep printed them (an array's
    task, 12_1, or a job alone, 13)."""
    found = re.findall(r"^#(\d+)(?: .*)?: SLURM job (\d+(?:_\d+)?)$", out, re.M)
    return {int(num): job for num, job in found}


def rows(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def statuses(sweep_dir: Path) -> dict[str, str]:
    """compare.json's rows: label → status."""
    report = json.loads((sweep_dir / "compare.json").read_text())
    return {r["label"]: r["status"] for r in report}


def test_a_sweep_with_the_launchers_defaults_trains_and_says_why_a_job_waits(slurm, tmp_path, name):
    """trainer.device and cpus_per_task/mem_gb at slurm.yaml's defaults (auto, 2 CPUs, 8 GB):
    submitted from here (no GPU), each job takes the node's 2 CPUs, so the second waits for the
    first, and the sweep says so (SLURM's reason) instead of waiting without a word."""
    sweep_dir = tmp_path / "sweep"
    args = command(sweep_dir, name, "precision=fp32,bf16", "trainer.max_steps=30")
    proc = cli(*args, cwd=tmp_path, env=environment(slurm))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert re.search(r"^#1 precision=bf16: SLURM job \d+_1 pending \(Resources\)$", out, re.M), out
    assert statuses(sweep_dir) == {"fp32": "completed", "bf16": "completed"}
    assert (sweep_dir / "compare.md").exists()
    for job in ("0", "1"):
        summary = json.loads((sweep_dir / job / "summary.json").read_text())
        assert summary["device"] == "cpu" and summary["steps"] == 30


@pytest.mark.parametrize(
    "asked, named",
    [
        # trainer.device=cuda is checked on the node, not here: the line is about the CPUs
        (
            ["hydra.launcher.cpus_per_task=3", "trainer.device=cuda"],
            "hydra.launcher.cpus_per_task=3 is more than partition debug's nodes have "
            "(at most 2 CPUs each): set hydra.launcher.cpus_per_task=2 or less",
        ),
        (
            ["hydra.launcher.mem_gb=64"],
            "hydra.launcher.mem_gb=64 is more than partition debug's nodes have (at most ",
        ),
        (
            ["hydra.launcher.gpus_per_node=1"],
            "hydra.launcher.gpus_per_node=1 is more than partition debug's nodes have (no GPU)",
        ),
    ],
    ids=["cpus", "memory", "gpus"],
)
def test_a_request_the_partition_cannot_meet_is_refused_before_submission(
    slurm, tmp_path, name, asked, named
):
    sweep_dir = tmp_path / "sweep"
    args = command(sweep_dir, name, "precision=fp32,bf16", *asked)
    try:  # submitted, such a sweep would wait for ever: a minute says it was not refused
        proc = subprocess.run(
            [sys.executable, "-m", "runner", *args],
            env=environment(slurm),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"not refused: the sweep was still waiting after 60 s:\n{e.stderr}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = proc.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith(f"error: {named}"), line
    assert not (sweep_dir / ".submitit").exists()
    listed = slurm.run("sacct", "-n", "-X", "-S", "now-10minutes", "--name", name, "-o", "JobID")
    assert listed.stdout.strip() == ""  # nothing submitted: not in accounting either


def test_a_cancelled_job_is_named_and_the_same_command_completes_the_sweep(slurm, tmp_path, name):
    sweep_dir, log = tmp_path / "sweep", tmp_path / "sweep.log"
    args = command(sweep_dir, name, "precision=fp32,bf16", *SMALL, *LONG)
    proc = start(slurm, args, log)
    wait_until(lambda: rows(sweep_dir / "1") >= 50, 120, "job 1 trains")
    job = submissions(log.read_text())[1]
    slurm.run("scancel", job)
    out = finish(proc, log)
    assert proc.returncode == 1, out[-3000:]
    assert f"#1 precision=bf16: SLURM job {job} CANCELLED" in out
    assert "error: 1 of 2 jobs did not complete" in out
    assert "complete it: run the same command: the jobs that completed are read back" in out
    assert statuses(sweep_dir) == {"fp32": "completed", "bf16": "preempted"}  # by the SIGTERM
    assert f"failed: SLURM job {job} CANCELLED" in (sweep_dir / "compare.md").read_text()

    proc = start(slurm, args, log)
    out = finish(proc, log)
    assert proc.returncode == 0, out[-3000:]
    assert "#0 precision=fp32: completed before" in out
    assert statuses(sweep_dir) == {"fp32": "completed", "bf16": "completed"}
    again = submissions(out)
    assert list(again) == [1], out[-3000:]  # the cancelled job alone, one SLURM job
    new = again[1]
    listed = slurm.run("sacct", "-n", "-X", "-P", "-j", new.split("_")[0], "-o", "JobID")
    assert listed.stdout.split() == [new]
    steps = [r["step"] for r in read_metrics(sweep_dir / "1")]
    assert steps[-1] == 2000 and steps == sorted(set(steps))
    resumed = resumed_at(job_log(sweep_dir, new))
    assert len(resumed) == 1 and resumed[0] >= 50, resumed  # where it was cancelled


def test_without_accounting_the_sweep_says_so_and_still_ends(slurm, tmp_path, name):
    """sacct cannot reach slurmdbd (this client's slurm.conf names a port where none listens;
    the controller, sbatch and squeue are the real ones): one warning line before submission,
    and a cancelled job is reported with the state the queue last showed, instead of a sweep
    that waits for ever on accounting."""
    conf = tmp_path / "slurm.conf"
    real = Path(slurm.env["SLURM_CONF"]).read_text()
    conf.write_text(re.sub(r"(?m)^AccountingStoragePort=.*$", "AccountingStoragePort=9", real))
    broken = type(slurm)(env={**slurm.env, "SLURM_CONF": str(conf)}, partition=slurm.partition)
    assert broken.run("sacct", "-n", "-X", check=False).returncode != 0
    sweep_dir, log = tmp_path / "sweep", tmp_path / "sweep.log"
    proc = start(broken, command(sweep_dir, name, "precision=fp32", *SMALL, *LONG), log)
    wait_until(lambda: rows(sweep_dir / "0") >= 50, 120, "the job trains")
    out = log.read_text()
    assert out.startswith("warning: SLURM accounting does not answer (sacct failed: "), out
    job = submissions(out)[0]
    slurm.run("scancel", job)
    out = finish(proc, log, timeout=90)
    assert proc.returncode == 1, out[-3000:]
    assert f"#0: SLURM job {job} CANCELLED" in out
    assert statuses(sweep_dir) == {"fp32": "preempted"}


def job_log(sweep_dir: Path, job: str) -> str:
    """What SLURM job `job` printed, every task (submitit's log files)."""
    return "".join(p.read_text() for p in sorted((sweep_dir / ".submitit" / job).glob("*_log.*")))


def resumed_at(log: str) -> list[int]:
    """The steps a job's log says it resumed at (the console wraps a long line: joined)."""
    return [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", log.replace("\n", ""))]


def rank_process(job: str, rank: int) -> int | None:
    """The pid of rank `rank`'s Python process of SLURM job `job`: the task srun started with
    SLURM_PROCID=rank."""
    wanted = {f"SLURM_JOB_ID={job}", f"SLURM_PROCID={rank}"}
    if "_" in job:  # an array's task: SLURM_JOB_ID is the task's own id
        array, task = job.split("_")
        wanted = {
            f"SLURM_ARRAY_JOB_ID={array}",
            f"SLURM_ARRAY_TASK_ID={task}",
            f"SLURM_PROCID={rank}",
        }
    for proc in Path("/proc").iterdir():
        try:
            environ = set((proc / "environ").read_bytes().decode(errors="replace").split("\0"))
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if wanted <= environ and b"submitit.core._submit" in cmdline:
            return int(proc.name)
    return None


def test_a_ddp_job_whose_rank_is_killed_fails_and_resumes_when_rerun(slurm, tmp_path, name):
    """+launcher=slurm_ddp, 2 tasks on gloo: SIGKILL to rank 1 mid-run fails the job (FAILED in
    accounting, named by the sweep), and the same command resumes it from its last checkpoint."""
    sweep_dir, log = tmp_path / "sweep", tmp_path / "sweep.log"
    ddp = ["hydra.launcher.tasks_per_node=2", "hydra.launcher.mem_gb=2", "trainer.device=cpu"]
    args = command(
        sweep_dir,
        name,
        "precision=fp32",
        "hydra.launcher.cpus_per_task=1",
        *ddp,
        *LONG,
        "trainer.max_steps=600",  # a DDP step takes about 20 ms here (gloo, two shared CPUs)
        launcher="+launcher=slurm_ddp",
    )
    proc = start(slurm, args, log)
    wait_until(lambda: rows(sweep_dir / "0") >= 150, 120, "the job trains past a checkpoint")
    job = submissions(log.read_text())[0]
    os.kill(wait_until(lambda: rank_process(job, 1), 30, "rank 1's process"), signal.SIGKILL)
    out = finish(proc, log)
    assert proc.returncode == 1, out[-3000:]
    wait_until(lambda: slurm.state(job) == "FAILED", 30, f"job {job} FAILED in sacct")
    assert f"#0: SLURM job {job} FAILED" in out  # a sweep of one job: nothing varies
    # The comparison names it too, whatever the failed rank's error holds (gloo's "[/pytorch/..."
    # is no markup to the printed table).
    assert "error: 1 of 1 jobs did not complete" in out and "MarkupError" not in out, out[-3000:]
    # Rank 0 met the dead peer as a gloo error: it failed its task too, and no task of the job
    # "completed successfully" (submitit's word for a task that returned).
    killed = job_log(sweep_dir, job)
    assert "error: job 0 failed:" in killed, killed[-3000:]
    assert "task 0: Exited with exit code 1" in killed and "completed successfully" not in killed
    assert statuses(sweep_dir) == {"fp32": "failed"}

    proc = start(slurm, args, log)
    out = finish(proc, log)
    assert proc.returncode == 0, out[-3000:]
    new = submissions(out)[0]
    resumed = resumed_at(job_log(sweep_dir, new))
    assert len(resumed) == 1 and resumed[0] >= 100, resumed  # its last checkpoint
    summary = json.loads((sweep_dir / "0" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert read_metrics(sweep_dir / "0")[-1]["step"] == 600
