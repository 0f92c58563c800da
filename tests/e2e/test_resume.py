"""Killed, preempted and resumed runs through the real CLI: nothing lost, nothing different."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runner.run import run
from tests.helpers import TINY_MLP, cli, load_last, make_cfg, read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# Dropout on, so the resumed run must also restore the RNG exactly.
RESUMABLE = [
    *TINY_MLP,
    "model.dropout=0.1",
    "trainer.max_steps=24",
    "trainer.log_every_n_steps=1",
    "trainer.checkpoint_every_n_steps=5",
    "trainer.val_check_interval=8",
]
KILLED_BEFORE = 13  # after the checkpoint of step 10 and the rows of steps 11 and 12
SAME_IN_BOTH = (
    "step",
    "loss",
    "grad_norm",
    "loss_scale",
    "skipped",
    "skipped_total",
    "lr",
    "eval_loss",
    "eval_accuracy",
)
PATIENCE_S = 600  # for a loaded machine: a wait ends as soon as what it waits for is there


def _start(args, cwd, stall_before: int | None = None, marker: Path | None = None):
    """`python -m runner ARGS`, its output to cwd/run.log; with `stall_before`, training stops
    for good before that step, once `marker` is written (tests.probes.stalled_cli)."""
    command = ["-m", "runner"]
    if stall_before is not None:
        probe = "from tests.probes import stalled_cli; stalled_cli()"
        command = ["-c", probe, str(stall_before), str(marker)]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    with open(Path(cwd) / "run.log", "w") as log:  # a pipe nobody reads could fill and block
        return subprocess.Popen(
            [sys.executable, *command, *args],
            cwd=cwd,
            env=os.environ | {"PYTHONPATH": path},
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )


def _output(cwd) -> str:
    return (Path(cwd) / "run.log").read_text()


def _wait_for(path: Path, proc: subprocess.Popen, cwd) -> None:
    """Until `path` exists; a run that ends first fails the test at once, with its output."""
    deadline = time.monotonic() + PATIENCE_S
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"the run ended ({proc.returncode}) before {path.name}:\n{_output(cwd)}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{path.name} did not appear in {PATIENCE_S} s:\n{_output(cwd)}")
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["fp32", "fp16"])  # bf16 keeps no state beyond fp32's
def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, mode):
    overrides = [*RESUMABLE, f"precision={mode}"]
    if mode == "fp16":  # a scale that overflows at first: the resumed run must carry it over
        overrides.append("precision.grad_scaler.init_scale=1e10")
    whole = tmp_path / "whole"
    run(make_cfg(*overrides), whole)

    killed = tmp_path / "killed"
    stalled = tmp_path / "stalled"
    args = [*overrides, f"hydra.run.dir={killed}"]
    proc = _start(args, tmp_path, stall_before=KILLED_BEFORE, marker=stalled)
    _wait_for(stalled, proc, tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(read_metrics(killed)) == KILLED_BEFORE - 1
    assert load_last(killed)["step"] == 10  # steps 11 and 12 are logged past the checkpoint
    resumed = cli(*overrides, "trainer.resume=auto", f"hydra.run.dir={killed}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr

    a, b = load_last(whole), load_last(killed)
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert a["scaler"] == b["scaler"]
    rows_a, rows_b = read_metrics(whole), read_metrics(killed)
    assert [r["step"] for r in rows_b] == list(range(1, 25))  # no duplicates, no gaps
    for ra, rb in zip(rows_a, rows_b, strict=True):
        assert {k: ra.get(k) for k in SAME_IN_BOTH} == {k: rb.get(k) for k in SAME_IN_BOTH}
    if mode == "fp16":  # it overflows past step 10 (where the resumed run starts), not to the end
        assert rows_a[0]["skipped"] and rows_a[10]["skipped"] and not rows_a[-1]["skipped"]


def test_sigterm_checkpoints_and_exits_with_the_documented_code(tmp_path):
    out = tmp_path / "run"
    args = [
        *TINY_MLP,
        "trainer.max_steps=100000",
        "trainer.log_every_n_steps=1",
        "trainer.checkpoint_every_n_steps=7",
        "logger=wandb",
        f"hydra.run.dir={out}",
    ]
    proc = _start(args, tmp_path)
    _wait_for(out / "checkpoints" / "step-7.pt", proc, tmp_path)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=PATIENCE_S)
    stderr = _output(tmp_path)
    assert proc.returncode == 75, stderr
    assert "preempted by SIGTERM" in stderr and "Traceback" not in stderr
    state = load_last(out)
    rows = read_metrics(out)
    assert state["step"] == len(rows) == rows[-1]["step"] >= 7
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "preempted"
    first_run = state["wandb_run_id"]
    assert first_run and list(out.glob(f"wandb/offline-run-*-{first_run}"))
    again = cli(
        *args, f"trainer.max_steps={state['step'] + 3}", "trainer.resume=auto", cwd=tmp_path
    )
    assert again.returncode == 0, again.stderr
    assert len(list(out.glob(f"wandb/offline-run-*-{first_run}"))) == 2  # the same W&B run
    assert load_last(out)["wandb_run_id"] == first_run
    assert [r["step"] for r in read_metrics(out)] == list(range(1, state["step"] + 4))
