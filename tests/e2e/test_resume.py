"""Killed, preempted and resumed runs through the real CLI: nothing lost, nothing different."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from runner.run import run
from tests.helpers import TINY_BERT, cli, load_last, make_cfg, read_metrics

pytestmark = pytest.mark.slow

# Dropout on, so the resumed run must also restore the RNG exactly.
RESUMABLE = [
    *TINY_BERT,
    "model.dropout=0.1",
    "trainer.max_steps=150",
    "trainer.log_every_n_steps=1",
    "trainer.checkpoint_every_n_steps=7",
    "trainer.val_check_interval=50",
]
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


def _start(args, cwd):
    return subprocess.Popen(
        [sys.executable, "-m", "runner", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path, timeout=120):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.005)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16"])
def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, mode):
    overrides = [*RESUMABLE, f"precision={mode}"]
    if mode == "fp16":  # a scale that overflows at first: the resumed run must carry it over
        overrides.append("precision.grad_scaler.init_scale=1e12")
    whole = tmp_path / "whole"
    run(make_cfg(*overrides), whole)

    killed = tmp_path / "killed"
    proc = _start([*overrides, f"hydra.run.dir={killed}"], tmp_path)
    _wait_for(killed / "checkpoints" / "step-21.pt")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    interrupted_at = len(read_metrics(killed))
    assert interrupted_at < 150
    resumed = cli(*overrides, "trainer.resume=auto", f"hydra.run.dir={killed}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr

    a, b = load_last(whole), load_last(killed)
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert a["scaler"] == b["scaler"]
    rows_a, rows_b = read_metrics(whole), read_metrics(killed)
    assert [r["step"] for r in rows_b] == list(range(1, 151))  # no duplicates, no gaps
    for ra, rb in zip(rows_a, rows_b, strict=True):
        assert {k: ra.get(k) for k in SAME_IN_BOTH} == {k: rb.get(k) for k in SAME_IN_BOTH}
    if mode == "fp16":
        assert rows_a[0]["skipped"] and not rows_a[-1]["skipped"]


def test_sigterm_checkpoints_and_exits_with_the_documented_code(tmp_path):
    out = tmp_path / "run"
    args = [*RESUMABLE, "trainer.max_steps=100000", "logger=wandb", f"hydra.run.dir={out}"]
    proc = _start(args, tmp_path)
    _wait_for(out / "checkpoints" / "step-7.pt")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
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
