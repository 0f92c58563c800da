"""Reruns through the real command line that must not mix runs (runner/folders.py): a sweep run
again with other values is refused before anything in its folder is rewritten; the comparison
reads only the jobs of its own sweep; a second command over a running sweep is refused naming
the first; a run killed before its first checkpoint continues its one W&B run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner import wandb_file
from tests.helpers import cli, read_metrics

pytestmark = pytest.mark.slow

ENV = os.environ | {"OMP_NUM_THREADS": "1"}
SMALL = [
    "model=mlp",
    "dataset.num_samples=256",
    "logger=none",
    "trainer.progress_bar=false",
    "trainer.val_check_interval=0",
    "trainer.checkpoint_every_n_steps=5",
]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def sweep_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return cli("-m", *SMALL, *args, f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, env=ENV)


def test_a_sweep_rerun_with_other_values_is_refused_before_anything_is_written(tmp_path):
    """The issue's cases: a changed learning rate over a stopped job (it would resume the old
    run under the new label) and over a completed one (it would be read back under it), and
    another precision list over a folder holding a bf16 job."""
    ran = ["precision=fp32,bf16", "optim.optimizer.lr=0.001"]
    first = sweep_cli(tmp_path, *ran, "trainer.max_steps=10")
    assert first.returncode == 0, first.stderr[-3000:]
    sweep = tmp_path / "sweep"
    before = snapshot(sweep)
    for args, said in (
        (
            ["precision=fp32,bf16", "optim.optimizer.lr=0.1,0.01", "trainer.max_steps=20"],
            "job 0 (" + str(sweep / "0") + ") asks optim.optimizer.lr=0.1 (it ran: 0.001)",
        ),
        (["precision=fp32,bf16", "optim.optimizer.lr=0.03"], "asks optim.optimizer.lr=0.03"),
        (
            ["precision=fp32,fp16", "optim.optimizer.lr=0.001", "trainer.max_steps=10"],
            "asks precision=fp16 (it ran: bf16)",
        ),
    ):
        again = sweep_cli(tmp_path, *args)
        assert again.returncode == 2, again.stderr[-3000:]
        lines = again.stderr.strip().splitlines()
        assert len(lines) == 1 and said in lines[0] and "Traceback" not in again.stderr, lines
        assert "hydra.sweep.dir=" in lines[0]  # what to do instead
        assert snapshot(sweep) == before
    same = sweep_cli(tmp_path, *ran, "trainer.max_steps=10")
    assert same.returncode == 0 and same.stderr.count("the run had finished") == 2, same.stderr


def test_the_comparison_reads_only_its_own_sweeps_jobs(tmp_path):
    """A 3-job sweep, then a 2-job one over the same folder: the third job, stale and failed,
    is named as not part of the sweep, not compared and not counted (exit 0)."""
    first = sweep_cli(tmp_path, "precision=fp32,bf16,fp16", "trainer.max_steps=6")
    assert first.returncode == 0, first.stderr[-3000:]
    sweep = tmp_path / "sweep"
    summary = json.loads((sweep / "2" / "summary.json").read_text())
    (sweep / "2" / "summary.json").write_text(json.dumps(summary | {"status": "failed"}))
    second = sweep_cli(tmp_path, "precision=fp32,bf16", "trainer.max_steps=6")
    out = " ".join((second.stdout + second.stderr).split())
    assert second.returncode == 0, out[-3000:]
    assert "not part of this sweep" in out and "2 (precision=fp16)" in out
    assert [r["precision"] for r in json.loads((sweep / "compare.json").read_text())] == [
        "fp32",
        "bf16",
    ]


def test_a_second_command_over_a_running_sweep_is_refused_naming_the_first(tmp_path):
    sweep = tmp_path / "sweep"
    args = [*SMALL, "precision=fp32", "trainer.max_steps=100000", f"hydra.sweep.dir={sweep}"]
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen(
        [sys.executable, "-m", "runner", "-m", *args], cwd=tmp_path, env=ENV, stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 120
        while not (sweep / "0" / "metrics.jsonl").exists():
            assert first.poll() is None and time.monotonic() < deadline, (
                tmp_path / "first.log"
            ).read_text()
            time.sleep(0.1)
        rows = len(read_metrics(sweep / "0"))
        second = cli("-m", *args, cwd=tmp_path, env=ENV)
        assert second.returncode == 2, second.stderr[-3000:]
        (line,) = second.stderr.strip().splitlines()
        assert f"{sweep} is in use by process {first.pid} on " in line
        assert "python -m runner -m" in line
        single = cli(
            *SMALL, "trainer.resume=auto", f"hydra.run.dir={sweep / '0'}", cwd=tmp_path, env=ENV
        )
        assert single.returncode == 2 and f"in use by process {first.pid}" in single.stderr
        assert first.poll() is None and len(read_metrics(sweep / "0")) >= rows  # left running
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()


def test_a_run_killed_before_its_first_checkpoint_continues_its_one_wandb_run(tmp_path):
    out = tmp_path / "run"
    args = [
        *[a for a in SMALL if not a.startswith(("logger=", "trainer.checkpoint"))],
        "logger=wandb",
        "trainer.checkpoint_every_n_steps=0",
        "trainer.log_every_n_steps=1",
        f"hydra.run.dir={out}",
    ]
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen(
        [sys.executable, "-m", "runner", *args, "trainer.max_steps=100000"],
        cwd=tmp_path,
        env=ENV,
        stdout=log,
        stderr=log,
    )
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 24):
        assert first.poll() is None and time.monotonic() < deadline, (
            tmp_path / "first.log"
        ).read_text()
        time.sleep(0.1)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    again = cli(*args, "trainer.max_steps=60", "trainer.resume=auto", cwd=tmp_path, env=ENV)
    assert again.returncode == 0, again.stderr[-3000:]
    run_ids = {p.name.rsplit("-", 1)[-1] for p in (out / "wandb").glob("offline-run-*")}
    assert run_ids == {json.loads((out / "run.json").read_text())["wandb_run_id"]}
    sent = [
        row["step"]
        for path in wandb_file.run_files(out, run_ids.pop())
        for row in wandb_file.history(path)
        if "loss" in row
    ]
    assert sorted(sent) == list(range(1, 61)), sent
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 61))


@pytest.mark.parametrize("launcher", [[], ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]])
def test_a_job_whose_resolved_values_changed_is_refused_and_fails_the_sweep(tmp_path, launcher):
    """The same overrides resolving to other values (an environment variable here; an edited
    config file alike): each job's own check refuses it before it writes anything, and the
    sweep's end names it and exits 2, whatever launcher ran it."""
    args = ["precision=fp32,bf16", "seed=${oc.env:SWEEP_SEED}", "trainer.max_steps=6", *launcher]

    def sweep_with(seed: str) -> subprocess.CompletedProcess:
        sweep = f"hydra.sweep.dir={tmp_path / 'sweep'}"
        return cli("-m", *SMALL, *args, sweep, cwd=tmp_path, env=ENV | {"SWEEP_SEED": seed})

    first = sweep_with("1")
    assert first.returncode == 0, first.stderr[-3000:]
    before = snapshot(tmp_path / "sweep" / "0")
    again = sweep_with("2")
    assert again.returncode == 2, again.stderr[-3000:]
    err = " ".join(again.stderr.split())
    assert "error: job 0: " in err and "error: job 1: " in err and "seed=2 (it ran: 1)" in err
    assert "Traceback" not in again.stderr
    assert snapshot(tmp_path / "sweep" / "0") == before
