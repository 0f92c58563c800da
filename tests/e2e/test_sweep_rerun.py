"""A sweep that loses jobs on the local launchers: the basic launcher's whole process killed, a
joblib worker killed. The comparison of what is left is written with the lost rows named
(joblib; a killed basic sweep has no process left to write it), and the same command again
completes the sweep: the jobs that completed are read back, the others continue from their last
checkpoint. (SLURM's cancelled and failed jobs: tests/cluster/test_slurm_sweeps.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import cli, read_metrics

pytestmark = pytest.mark.slow

LONG = [  # long enough to be killed mid-run (a step takes about 2 ms), checkpoints to resume
    "model=mlp",
    "logger=none",
    "trainer.progress_bar=false",
    "trainer.max_steps=2000",
    "trainer.checkpoint_every_n_steps=100",
    "trainer.val_check_interval=0",
]


def rows(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s", pytrace=False)
        time.sleep(0.1)
    return found


def statuses(sweep: Path) -> list[str]:
    return [r["status"] for r in json.loads((sweep / "compare.json").read_text())]


# One thread per process: on a shared 2-core machine torch's default threads contend, and a
# 2 ms step takes 100.
ENV = os.environ | {"OMP_NUM_THREADS": "1"}


def start(args: list[str], cwd: Path, log: Path, **popen) -> subprocess.Popen:
    """The sweep in the background, its output into `log`."""
    return subprocess.Popen(
        [sys.executable, "-m", "runner", *args],
        cwd=cwd,
        env=ENV,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        **popen,
    )


def test_a_killed_basic_sweep_is_completed_by_the_same_command(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "precision=fp32,bf16", *LONG, f"hydra.sweep.dir={sweep}"]
    proc = start(args, tmp_path, tmp_path / "sweep.log")
    wait_for(lambda: rows(sweep / "1") >= 150, 120, "job 1 trains past a checkpoint")
    proc.send_signal(signal.SIGKILL)  # the sweep's one process: job 0 done, job 1 mid-run
    proc.wait()
    again = cli(*args, cwd=tmp_path, env=ENV)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert "the run had finished" in out  # job 0, read back, not trained again
    resumed = [line for line in out.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and str(sweep / "1") in out, out[-3000:]
    assert statuses(sweep) == ["completed", "completed"]
    steps = [r["step"] for r in read_metrics(sweep / "1")]
    assert steps[-1] == 2000 and steps == sorted(set(steps))


def worker_writing(parent: int, folder: Path) -> int | None:
    """The pid of `parent`'s child process that has a file of `folder` open (joblib's worker
    running that job)."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    for pid in children:
        try:
            fds = Path(f"/proc/{pid}/fd").iterdir()
            if any(str(folder) + "/" in str(fd.readlink()) for fd in fds):
                return int(pid)
        except OSError:
            continue
    return None


def test_a_joblib_worker_killed_is_a_named_row_and_the_same_command_completes_it(tmp_path):
    """joblib stops every job when one of its workers dies: the comparison is written all the
    same, each lost job named, the command fails, and the same command completes the sweep."""
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "precision=fp32,bf16",
        *LONG,
        f"hydra.sweep.dir={sweep}",
    ]
    log = tmp_path / "sweep.log"
    proc = start(args, tmp_path, log)
    wait_for(lambda: rows(sweep / "1") >= 150, 120, "job 1 trains past a checkpoint")
    worker = wait_for(lambda: worker_writing(proc.pid, sweep / "1"), 30, "job 1's worker")
    os.kill(worker, signal.SIGKILL)  # the worker, not the sweep: the sweep must survive it
    proc.wait(timeout=120)
    out = log.read_text()
    assert proc.returncode == 1, out[-3000:]
    assert "error: a joblib worker died, and joblib stopped the others" in out
    report = json.loads((sweep / "compare.json").read_text())
    bf16 = next(r for r in report if r["precision"] == "bf16")
    assert bf16["status"] != "completed" and "a joblib worker died" in bf16["verdict"]
    assert "complete it: run the same command" in out

    again = cli(*args, cwd=tmp_path, env=ENV)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert statuses(sweep) == ["completed", "completed"]
    assert read_metrics(sweep / "1")[-1]["step"] == 2000
