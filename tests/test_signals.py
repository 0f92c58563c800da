"""Signals from the first line of a run to its last, and the job's time limit whatever the step
time (issue 45): a requeue signal decides whatever follows it, a signal before training stops the
run at once with its summary, one in the last step completes it, a resumed run's speed is its
every attempt's, and the end time asks for the requeue early enough."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from runner.errors import Preempted, UserError
from runner.run import run
from runner.train import deadline as deadline_module
from runner.train.deadline import Deadline
from runner.train.preemption import hand_on
from runner.train.trainer import Trainer
from tests.helpers import TINY_MLP, load_last, make_cfg, read_metrics

ROOT = Path(__file__).resolve().parents[1]
QUICK = [*TINY_MLP, "trainer.limit_val_batches=0", "trainer.log_every_n_steps=2"]


def send(*names: str) -> None:
    """This process sends itself each signal in turn, each handled before the next is sent."""
    for name in names:
        os.kill(os.getpid(), getattr(signal, name))
        time.sleep(0.05)


def signal_in_step(monkeypatch, step: int, *names: str) -> None:
    """The run's trainer sends itself `names` as optimizer step `step` begins."""
    train_step = Trainer.train_step

    def signalled(self, window):
        if self.step + 1 == step:
            send(*names)
        return train_step(self, window)

    monkeypatch.setattr(Trainer, "train_step", signalled)


@pytest.fixture
def submitit_like():
    """The handlers submitit leaves in a job's process: SIGTERM bypassed (so a run that did not
    catch it would go on), SIGUSR2 its requeue (counted here)."""
    requeued: list[int] = []
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: None),
        signal.SIGUSR2: signal.signal(signal.SIGUSR2, lambda *_: requeued.append(1)),
    }
    yield requeued
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def probe() -> None:
    """`python -c "from tests.test_signals import probe; probe()" WHEN SIGNALS MARKER ARGS...`:
    `python -m runner ARGS` in a process set up as submitit sets up a job's (SIGTERM bypassed;
    SIGUSR2 its requeue, which here writes MARKER), sending itself SIGNALS (comma-separated)
    before training (WHEN=setup) or as optimizer step WHEN begins."""
    import runpy

    import runner.run

    when, names, marker = sys.argv[1:4]
    sys.argv = [sys.argv[0], *sys.argv[4:]]
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGUSR2, lambda *_: Path(marker).write_text("requeued"))
    if when == "setup":
        before = runner.run._before_training

        def sending(*args, **kwargs):
            send(*names.split(","))
            return before(*args, **kwargs)

        runner.run._before_training = sending
    else:
        train_step = Trainer.train_step

        def signalled(self, window):
            if self.step + 1 == int(when):
                send(*names.split(","))
            return train_step(self, window)

        Trainer.train_step = signalled
    runpy.run_module("runner", run_name="__main__")


def run_probe(tmp_path: Path, when: str, names: str, *args: str) -> subprocess.CompletedProcess:
    marker = tmp_path / "requeued"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    command = "from tests.test_signals import probe; probe()"
    return subprocess.run(
        [sys.executable, "-c", command, when, names, str(marker), *args],
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_requeue_signal_followed_by_sigterm_still_requeues(tmp_path):
    """SLURM's SIGUSR2, then its SIGTERM at the limit: the run stops at the step it was in, and
    submitit's requeue handler is called (the last signal used to win: "preempted by SIGTERM",
    no requeue)."""
    out = tmp_path / "run"
    args = [*QUICK, "trainer.max_steps=40", f"hydra.run.dir={out}"]
    result = run_probe(tmp_path, "5", "SIGUSR2,SIGTERM", *args)
    assert result.returncode == 75, result.stderr[-3000:]
    assert "preempted by SIGUSR2 at step 5: checkpoint saved" in result.stderr
    assert (tmp_path / "requeued").exists()  # submitit's handler: the job is requeued
    assert load_last(out)["step"] == 5


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR2"])
def test_a_signal_before_training_stops_the_run_at_once_with_its_summary(tmp_path, name):
    """Before training (here: as the islands/max-batch searches would start) there is nothing to
    save: exit 75 with summary.json `preempted`, no checkpoint. It used to be exit 143 and no
    summary, or, with submitit's SIGTERM bypass, a run that trained to its end."""
    out = tmp_path / "run"
    result = run_probe(
        tmp_path, "setup", name, *QUICK, "trainer.max_steps=40", f"hydra.run.dir={out}"
    )
    assert result.returncode == 75, result.stderr[-3000:]
    assert f"preempted by {name} before training: nothing to checkpoint" in result.stderr
    assert "Traceback" not in result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "preempted" and "steps" not in summary
    assert not (out / "checkpoints").exists() and not read_metrics(out)
    assert (tmp_path / "requeued").exists() == (name == "SIGUSR2")  # requeued; a TERM is not


def test_a_signal_in_the_last_step_completes_the_run(tmp_path, monkeypatch, submitit_like):
    signal_in_step(monkeypatch, 14, "SIGTERM")
    cfg = make_cfg(*QUICK, "trainer.max_steps=14", "trainer.benchmark.warmup_steps=2")
    summary = run(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["steps"] == 14
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"
    assert summary["samples_per_s"] and summary["step_time_s"] and summary["speed_intervals"] == 6
    assert load_last(tmp_path)["step"] == 14
    assert not submitit_like  # nothing to requeue


def test_a_resumed_run_s_speed_is_every_attempt_s(tmp_path, monkeypatch, submitit_like):
    """Each attempt leaves its own warm-up out (trainer.benchmark.warmup_steps=2); the resumed
    run's speed figures are over both attempts' steady rows (it used to be the last attempt's
    only)."""
    overrides = [*QUICK, "trainer.max_steps=20", "trainer.benchmark.warmup_steps=2"]
    signal_in_step(monkeypatch, 9, "SIGTERM")
    with pytest.raises(Preempted):
        run(make_cfg(*overrides), tmp_path)
    monkeypatch.undo()
    summary = run(make_cfg(*overrides, "trainer.resume=auto"), tmp_path)
    rows = read_metrics(tmp_path)
    steady = [r for r in rows if r["steady"]]
    assert [r["step"] for r in steady] == [*range(3, 10), *range(12, 21)]
    # intervals: 3-4 5-6 7-8 9 | 12 13-14 15-16 17-18 19-20
    assert summary["speed_intervals"] == 9
    assert summary["samples_per_s"] == statistics.median(r["samples_per_s"] for r in steady)
    assert summary["step_time_s"] == statistics.median(r["step_time_s"] for r in steady)


def test_the_deadline_asks_for_the_stop_while_a_step_and_a_checkpoint_still_fit(monkeypatch):
    """Steps of 10 s, an end at 100 s, a checkpoint of 1 s and 5 s kept for the exit: asked
    before the step that starts at 80 s (the one asked for then ends at 90 s, its checkpoint at
    91 s, the exit by 96 s); at 70 s it was not yet time. Under DDP a stop is heard a step late:
    asked one step earlier."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(deadline_module.time, "monotonic", lambda: clock.now)
    for steps_after, asked_at in ((1, 80.0), (2, 70.0)):
        deadline = Deadline(100.0, "SLURM job 7 ends", steps_after, 5.0, 1.0)
        clock.now = 0.0
        while not deadline.near():
            clock.now += 10.0
        assert clock.now == asked_at, steps_after
        assert deadline.why() == (
            f"the time limit (SLURM job 7 ends in {100 - asked_at:.0f} s; "
            "a step takes 10.0 s, a checkpoint 1.0 s)"
        )


def test_a_time_limit_stops_the_run_in_time_and_asks_for_the_requeue(
    tmp_path, monkeypatch, submitit_like
):
    """trainer.time_limit_s (SLURM's end time does the same): steps of 0.2 s, 4 s from the run's
    start, 1 s kept for the exit: the run checkpoints and stops within the limit, and asks for
    the requeue as SLURM's SIGUSR2 would."""
    train_step = Trainer.train_step

    def slow(self, window):
        time.sleep(0.2)
        return train_step(self, window)

    monkeypatch.setattr(Trainer, "train_step", slow)
    limits = ["trainer.time_limit_s=4", "trainer.time_limit_margin_s=1"]
    cfg = make_cfg(*QUICK, "trainer.max_steps=60", *limits)
    started = time.monotonic()
    with pytest.raises(Preempted) as stopped:
        run(cfg, tmp_path)
    assert time.monotonic() - started < 4.0
    assert "preempted by the time limit (trainer.time_limit_s=4 runs out in" in str(stopped.value)
    step = stopped.value.step
    assert 1 <= step < 60 and load_last(tmp_path)["step"] == step == len(read_metrics(tmp_path))
    hand_on(stopped.value.signal_name)  # what `python -m runner` does next
    assert submitit_like == [1]


def test_a_bad_time_limit_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"trainer.time_limit_s.*auto.*seconds > 0, or null"):
        run(make_cfg(*QUICK, "trainer.time_limit_s=soon"), tmp_path)


def test_slurm_s_end_time_is_read_from_the_job_s_environment_or_the_queue(monkeypatch):
    """Slurm 22.05 (Debian 12's) sets no SLURM_JOB_END_TIME: squeue's %e (the EndTime of
    `scontrol show job`, local time) says it; a newer Slurm's variable is read without asking."""
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    asked = []

    def squeue(args, **_):
        asked.append(args)
        return SimpleNamespace(stdout="2026-12-06T05:27:50\n")

    monkeypatch.setattr(deadline_module.subprocess, "run", squeue)
    end = datetime(2026, 12, 6, 5, 27, 50).timestamp()
    assert deadline_module.slurm_end_time() == (end, "SLURM job 42 ends")
    assert asked == [["squeue", "-h", "-j", "42", "-o", "%e"]]
    monkeypatch.setenv("SLURM_JOB_END_TIME", "1796534870")
    assert deadline_module.slurm_end_time() == (1796534870.0, "SLURM job 42 ends")
    assert len(asked) == 1
    monkeypatch.delenv("SLURM_JOB_END_TIME")
    monkeypatch.setattr(
        deadline_module.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout="N/A")
    )
    assert deadline_module.slurm_end_time() is None  # no limit: the signals alone


def test_a_job_that_timed_out_with_a_checkpoint_goes_again_up_to_max_num_timeout(tmp_path):
    from runner.launch import sweep

    def job(state: str, checkpoint: bool) -> SimpleNamespace:
        folder = tmp_path / f"{state}-{checkpoint}"
        (folder / "checkpoints").mkdir(parents=True)
        if checkpoint:
            (folder / "checkpoints" / "last.pt").write_bytes(b"")
        result = SimpleNamespace(paths=SimpleNamespace(result_pickle=folder / "result.pkl"))
        submitted = SimpleNamespace(job_id="7", num_tasks=1, task=lambda i: result)
        return SimpleNamespace(
            num=len(state), folder=folder, state=state, reason="", submitted=submitted, label="#0"
        )

    resubmitted: dict[int, int] = {}
    timed_out = job("TIMEOUT", True)
    for _ in range(2):
        assert sweep._resubmit(timed_out, resubmitted, 2)
        timed_out.state = "TIMEOUT"
    assert not sweep._resubmit(timed_out, resubmitted, 2)  # max_num_timeout=2 reached
    assert sweep._resubmit(job("PREEMPTED", True), resubmitted, 2)
    assert not sweep._resubmit(job("FAILED", True), resubmitted, 2)
    assert not sweep._resubmit(job("CANCELLED", True), resubmitted, 2)
    assert not sweep._resubmit(job("TIMEOUT", False), {}, 2)  # nothing to resume from


SIGNAL_AT_LAST_STEP = """
import os, signal, sys
from runner.train.trainer import Trainer
train_step = Trainer.train_step
def signalled(self, window):
    if self.step + 1 == self.loop.max_steps and not os.environ.get("SIGNALLED"):
        os.environ["SIGNALLED"] = "1"  # job 0's last step only
        os.kill(os.getpid(), signal.SIGTERM)
    return train_step(self, window)
Trainer.train_step = signalled
import runpy
runpy.run_module("runner", run_name="__main__", alter_sys=True)
"""


def test_a_signal_as_a_basic_sweeps_job_completes_stops_the_sweep_there(tmp_path):
    """The job completes (the signal came in its last step), and the next job does not start as
    if nothing had been asked: the sweep stops, exit 75, and the same command completes it."""
    sweep = tmp_path / "sweep"
    args = ["-m", "precision=fp32,bf16", *QUICK, "trainer.max_steps=4", f"hydra.sweep.dir={sweep}"]
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def command(*how: str) -> subprocess.CompletedProcess:
        run = [sys.executable, *how, *args]
        return subprocess.run(
            run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )

    first = command("-c", SIGNAL_AT_LAST_STEP)
    assert first.returncode == 75, first.stderr[-3000:]
    assert "SIGTERM as job 0 completed: the sweep stops here" in " ".join(first.stderr.split())
    assert json.loads((sweep / "0" / "summary.json").read_text())["status"] == "completed"
    assert not (sweep / "1").exists()
    again = command("-m", "runner")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((sweep / "1" / "summary.json").read_text())["status"] == "completed"
