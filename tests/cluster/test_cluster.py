"""Smoke tests of the real cluster of scripts/cluster.sh: what the SLURM and Ray launchers rely on.

Each test proves one thing the runner's tests will need: accounting records a finished job
(submitit reads sacct), a requeued job runs again within seconds, signals reach the batch shell
and the job steps (scancel, and `--signal` before a time limit, as submitit asks for), two 1-CPU
jobs share the node, and the Ray head runs a remote function and a Hydra sweep.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from .conftest import wait_until

pytestmark = pytest.mark.cluster


def lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_sbatch_job_completes_in_sacct(slurm, tmp_path):
    out = tmp_path / "job.out"
    job = slurm.sbatch(f"--output={out}", "--wrap", "echo hello from job $SLURM_JOB_ID")
    wait_until(lambda: slurm.state(job) == "COMPLETED", 60, f"job {job} COMPLETED in sacct")
    assert lines(out) == [f"hello from job {job}"]


def test_requeue_runs_the_job_again(slurm, tmp_path):
    out = tmp_path / "job.out"
    job = slurm.sbatch(
        f"--output={out}",
        "--open-mode=append",  # the second run adds to the first's output
        "--wrap",
        'echo "start restart=${SLURM_RESTART_COUNT:-0}"; sleep 300',
    )
    try:
        wait_until(lambda: len(lines(out)) >= 1, 60, f"job {job} started")
        requeued = time.monotonic()
        slurm.run("scontrol", "requeue", job)
        # AuthInfo=cred_expire (10 s) holds a requeued job back; the scheduler's 2 s pass starts it
        wait_until(
            lambda: sum(x.startswith("start") for x in lines(out)) >= 2,
            60,
            f"job {job} started again after requeue",
        )
        took = time.monotonic() - requeued
    finally:
        slurm.run("scancel", job, check=False)
    starts = [x for x in lines(out) if x.startswith("start")]
    assert starts == ["start restart=0", "start restart=1"], lines(out)
    assert took < 30, f"the requeued job took {took:.0f} s to start again"


def test_scancel_signal_reaches_the_batch_script(slurm, tmp_path):
    out = tmp_path / "job.out"
    script = (
        'trap "echo got USR2; exit 0" USR2; echo started; for i in $(seq 3000); do sleep 0.1; done'
    )
    job = slurm.sbatch(f"--output={out}", "--wrap", script)
    try:
        wait_until(lambda: "started" in lines(out), 60, f"job {job} started")
        # --batch: to the shell itself (by default scancel signals the job's steps only)
        slurm.run("scancel", "--batch", "--signal=USR2", job)
        wait_until(lambda: "got USR2" in lines(out), 30, f"job {job}'s script got USR2")
        wait_until(
            lambda: slurm.state(job) == "COMPLETED", 30, f"job {job} COMPLETED after its trap"
        )
    finally:
        slurm.run("scancel", job, check=False)


STEP = """\
import signal, sys, time
def got(signum, frame):
    print("step got", signal.Signals(signum).name, flush=True)
    sys.exit(0)
signal.signal(signal.SIGUSR2, got)
print("step started", flush=True)
time.sleep(300)
"""


def test_scancel_signal_reaches_the_job_step(slurm, tmp_path):
    """submitit's jobs run their Python in an `srun` step: scancel --signal reaches it there."""
    (tmp_path / "step.py").write_text(STEP)
    out = tmp_path / "job.out"
    job = slurm.sbatch(
        f"--output={out}", f"--chdir={tmp_path}", "--wrap", f"srun {sys.executable} -u step.py"
    )
    try:
        wait_until(lambda: "step started" in lines(out), 60, f"job {job}'s step started")
        slurm.run("scancel", "--signal=USR2", job)
        wait_until(lambda: "step got SIGUSR2" in lines(out), 30, f"job {job}'s step got USR2")
    finally:
        slurm.run("scancel", job, check=False)


def test_time_limit_signal_arrives_before_the_limit(slurm, tmp_path):
    """`--signal=USR2@N` (submitit's signal_delay_s) comes before the time limit kills the job.
    slurmctld checks time limits every 30 s, so this waits up to about that long."""
    out = tmp_path / "job.out"
    script = (
        'trap "echo got USR2; exit 0" USR2; echo started; for i in $(seq 3000); do sleep 0.1; done'
    )
    job = slurm.sbatch(f"--output={out}", "--time=1", "--signal=B:USR2@59", "--wrap", script)
    try:
        wait_until(
            lambda: "got USR2" in lines(out),
            70,
            f"job {job}'s script got USR2 before its 1-minute limit",
        )
        wait_until(lambda: slurm.state(job) == "COMPLETED", 30, f"job {job} COMPLETED, not TIMEOUT")
    finally:
        slurm.run("scancel", job, check=False)


def test_two_one_cpu_jobs_run_at_once(slurm, tmp_path):
    """Cores and memory are consumable (CR_Core_Memory, DefMemPerCPU): a job takes 1 CPU of the
    node, not all of it, so a sweep's jobs run side by side."""
    jobs = [
        slurm.sbatch("--cpus-per-task=1", f"--output={tmp_path}/%j.out", "--wrap", "sleep 300")
        for _ in range(2)
    ]

    def running() -> list[str]:
        squeue = ("squeue", "-h", "-t", "RUNNING", "-j", ",".join(jobs), "-o", "%i")
        return sorted(slurm.run(*squeue).stdout.split())

    try:
        wait_until(lambda: running() == sorted(jobs), 30, f"jobs {jobs} running at once")
    finally:
        slurm.run("scancel", *jobs, check=False)


def test_ray_runs_a_remote_function_on_the_head(ray_head):
    import ray

    ray.init(address=ray_head, log_to_driver=False)
    try:

        @ray.remote
        def double(x: int) -> tuple[int, int]:
            return 2 * x, os.getpid()

        value, pid = ray.get(double.remote(21), timeout=60)
        nodes = [n for n in ray.nodes() if n["Alive"]]
    finally:
        ray.shutdown()
    assert value == 42
    assert pid != os.getpid()  # a worker of the head ran it, not this process
    assert [n["NodeManagerAddress"] for n in nodes] == ["127.0.0.1"]


APP = """\
import os

import hydra


@hydra.main(version_base=None, config_path=None)
def main(cfg):
    print(f"x={cfg.x} pid={os.getpid()}", flush=True)


if __name__ == "__main__":
    main()
"""


def test_hydra_ray_launcher_sweeps_on_the_head(ray_head, cluster_env, tmp_path):
    """hydra-ray-launcher (the `ray` extra) beside hydra-core 1.3 runs a sweep's jobs on the head.
    Its launch() sets ray.init's object_store_memory, which ray.init refuses when it joins a
    running cluster: a null value is the way around."""
    pytest.importorskip(
        "hydra_plugins.hydra_ray_launcher", reason="the `ray` extra is not installed"
    )
    (tmp_path / "app.py").write_text(APP)
    proc = subprocess.run(
        [
            sys.executable,
            "app.py",
            "-m",
            "+x=1,2",
            "hydra/launcher=ray",
            f"+hydra.launcher.ray.init.address={ray_head}",
            "+hydra.launcher.ray.init.object_store_memory=null",
            f"hydra.sweep.dir={tmp_path}/multirun",
        ],
        cwd=tmp_path,
        env={**os.environ, **cluster_env},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    # each job's line as Ray forwards a worker's output: "(_run_job pid=N) x=1 pid=N"
    ran = sorted(x for _, x in re.findall(r"\(_run_job pid=(\d+)\)\S*\s+x=(\d) pid=\1", log))
    assert ran == ["1", "2"], log[-3000:]
    assert sorted(p.name for p in (tmp_path / "multirun").iterdir() if p.is_dir()) == ["0", "1"]
