"""Signals to a sweep on the local launchers, as a scheduler or a terminal sends them. Under
joblib: a signal to one worker preempts that job only (the others run on, the comparison names
it); a signal to the sweep's process or to its whole group, or Ctrl-C, checkpoints every running
job, starts no other, and leaves no process behind. Under the basic launcher: SIGTERM checkpoints
the running job and ends the sweep (75). The same command again completes the sweep each time."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.e2e import test_sweep_rerun as sweep_rerun
from tests.e2e.test_sweep_rerun import ENV, LONG, rows, statuses, wait_for, worker_writing
from tests.helpers import cli, read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 1000  # each job checkpoints every 100 steps and is signalled after its 150th
RUN = [*(o for o in LONG if not o.startswith("trainer.max_steps=")), f"trainer.max_steps={STEPS}"]


def joblib_sweep(sweep: Path, precisions: str) -> list[str]:
    return [
        "-m",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        f"precision={precisions}",
        *RUN,
        f"hydra.sweep.dir={sweep}",
    ]


def start(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """The sweep in the background, in a process group of its own (as a terminal's job is), its
    output into `log`."""
    return sweep_rerun.start(args, cwd, log, start_new_session=True)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def descendants(pid: int) -> dict[int, str]:
    """Every process below `pid`, with its start time (a pid may be reused once it is gone)."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            for child in children:
                if (started := start_time(child)) is not None:
                    found[child] = started
                    todo.append(child)
    return found


def start_time(pid: int) -> str | None:
    """The process's start time, None where it is gone (a zombie is gone: it runs nothing)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else fields[19]


def left_behind(processes: dict[int, str]) -> list[int]:
    return [pid for pid, started in processes.items() if start_time(pid) == started]


@pytest.fixture
def leftovers():
    """The processes a test started (pid: start time, filled by the test); any still running
    after it (a failed test's) is ended, by pid."""
    processes: dict[int, str] = {}
    yield processes
    for pid in left_behind(processes):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def watched(proc: subprocess.Popen, leftovers: dict[int, str]) -> dict[int, str]:
    """The sweep's process and every process below it, now, added to `leftovers`."""
    below = descendants(proc.pid)
    leftovers.update(below)
    leftovers[proc.pid] = start_time(proc.pid) or ""
    return below


def completes_again(args: list[str], cwd: Path, sweep: Path, resumed: list[str]) -> None:
    """The same command again completes the sweep: each job in `resumed` continues from its
    checkpoint, and every job trains each step once."""
    again = cli(*args, cwd=cwd, env=ENV)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    flat = out.replace("\n", "")  # the console wraps long lines, paths too
    assert flat.count("resumed from") == len(resumed), out[-3000:]
    for job in resumed:
        assert f"resumed from {sweep / job}/checkpoints/last.pt" in flat, out[-3000:]
    assert set(statuses(sweep)) == {"completed"}
    for job in resumed:
        steps = [r["step"] for r in read_metrics(sweep / job)]
        assert steps == list(range(1, STEPS + 1)), job


def test_hydra_launcher_joblib_is_amp_runners_from_the_repository_root():
    """Run from the repository's root, Hydra's plugin scan meets this project's plugins first,
    and the joblib plugin's own config module, run after them, stored Hydra's launcher back."""
    shown = cli(
        "hydra/launcher=joblib", "--cfg", "hydra", "-p", "hydra.launcher._target_", cwd=REPO
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.strip() == "hydra_plugins.amp_runner_launcher.joblib.JoblibLauncher"


def test_sigterm_to_one_joblib_worker_preempts_its_job_and_the_other_runs_on(tmp_path, leftovers):
    sweep = tmp_path / "sweep"
    args = joblib_sweep(sweep, "fp32,bf16")
    log = tmp_path / "sweep.log"
    proc = start(args, tmp_path, log)
    wait_for(lambda: rows(sweep / "0") >= 150 and rows(sweep / "1") >= 150, 120, "both jobs train")
    worker = wait_for(lambda: worker_writing(proc.pid, sweep / "1"), 30, "job 1's worker")
    below = watched(proc, leftovers)
    os.kill(worker, signal.SIGTERM)
    proc.wait(timeout=180)
    out = log.read_text()
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    preempted = summary(sweep / "1")
    assert preempted["status"] == "preempted", preempted
    assert (sweep / "1" / "checkpoints" / "last.pt").exists()
    # The other job, untouched: every step once, to its end.
    assert summary(sweep / "0")["status"] == "completed"
    assert [r["step"] for r in read_metrics(sweep / "0")] == list(range(1, STEPS + 1))
    report = {r["precision"]: r for r in json.loads((sweep / "compare.json").read_text())}
    assert report["fp32"]["status"] == "completed"
    assert report["bf16"]["status"] != "completed"
    assert "preempted by SIGTERM" in report["bf16"]["verdict"], report["bf16"]
    assert "checkpoint saved; continue the sweep: run the same command" in out
    assert "complete it: run the same command" in out
    wait_for(lambda: not left_behind(below), 10, f"the sweep's processes {below} end")

    completes_again(args, tmp_path, sweep, resumed=["1"])


@pytest.mark.parametrize("how", ["SIGTERM to its process", "SIGTERM to its group", "Ctrl-C"])
def test_a_signal_to_a_joblib_sweep_checkpoints_every_job_and_leaves_no_process(
    tmp_path, how, leftovers
):
    """The two running jobs checkpoint and stop, a third waiting for a worker never starts
    (one case has one: each case takes 20-60 s on 2 busy cores); the command fails with how to
    complete the sweep, and no worker outlives it."""
    waiting = how == "SIGTERM to its process"
    sweep = tmp_path / "sweep"
    args = joblib_sweep(sweep, "fp32,bf16,fp16" if waiting else "fp32,bf16")
    log = tmp_path / "sweep.log"
    proc = start(args, tmp_path, log)
    wait_for(lambda: rows(sweep / "0") >= 150 and rows(sweep / "1") >= 150, 120, "both jobs train")
    below = watched(proc, leftovers)
    assert len(below) >= 2, below  # the two workers (and joblib's resource trackers)
    if how == "SIGTERM to its process":
        proc.send_signal(signal.SIGTERM)
    else:  # the whole group, as a scheduler's kill or a terminal's Ctrl-C reaches it
        os.killpg(proc.pid, signal.SIGTERM if how == "SIGTERM to its group" else signal.SIGINT)
    proc.wait(timeout=180)
    out = log.read_text()
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    received = "SIGINT" if how == "Ctrl-C" else "SIGTERM"
    assert f"{received}: stopping the sweep: each running job saves a checkpoint" in out
    for job in ("0", "1"):
        stopped = summary(sweep / job)
        assert stopped["status"] == "preempted", (job, stopped)
        assert (sweep / job / "checkpoints" / "last.pt").exists()
    if waiting:
        assert not (sweep / "2" / "metrics.jsonl").exists()
        report = json.loads((sweep / "compare.json").read_text())
        fp16 = next(r for r in report if r["precision"] == "fp16")
        assert f"not started: the sweep was stopped by {received}" in fp16["verdict"], fp16
    assert "complete it: run the same command" in out
    wait_for(lambda: not left_behind(below), 10, f"the sweep's processes {below} end")

    completes_again(args, tmp_path, sweep, resumed=["0", "1"])


def test_sigterm_to_a_basic_sweep_checkpoints_its_job_and_the_same_command_continues(
    tmp_path, leftovers
):
    sweep = tmp_path / "sweep"
    args = ["-m", "precision=fp32,bf16", *RUN, f"hydra.sweep.dir={sweep}"]
    log = tmp_path / "sweep.log"
    proc = start(args, tmp_path, log)
    wait_for(lambda: rows(sweep / "1") >= 150, 120, "job 1 trains")
    watched(proc, leftovers)
    proc.send_signal(signal.SIGTERM)  # the sweep's one process: job 0 done, job 1 mid-run
    proc.wait(timeout=120)
    out = log.read_text()
    assert proc.returncode == 75, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert summary(sweep / "1")["status"] == "preempted"
    lines = [line for line in out.splitlines() if line.startswith("preempted by SIGTERM")]
    assert len(lines) == 1 and lines[0].endswith(
        ": checkpoint saved; continue the sweep: run the same command"
    ), out[-3000:]

    completes_again(args, tmp_path, sweep, resumed=["1"])
