"""precision.autopilot=true,false as a user sweeps it (issue 48): two rows of one comparison, each
with its loss gap and its share of FLOPs in fp8; the autopilot's switches and its per-step share
in its W&B run, read back from the offline file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from runner import wandb_file
from tests.helpers import cli

REPO = Path(__file__).resolve().parents[2]  # the jobs import tests/autopilot_nets.py
pytestmark = pytest.mark.slow
pytest.importorskip("torchao")


def test_autopilot_true_false_are_rows_of_the_comparison(tmp_path):
    sweep = tmp_path / "sweep"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = cli(
        "-m",
        "precision=fp8",
        "precision.autopilot=true,false",
        "precision.autopilot.every_n_steps=10",
        "model=module",
        "model.net._target_=tests.autopilot_nets.ActivationOutlier",
        "dataset=blobs",
        "trainer.max_steps=80",
        "trainer.val_check_interval=80",
        "trainer.progress_bar=false",
        "logger=wandb",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert "autopilot: step 41: net.body.1 forward → bf16" in out, out[-3000:]
    rows = {r["label"]: r for r in json.loads((sweep / "compare.json").read_text())}
    assert len(rows) == 2, list(rows)
    assert set(rows) == {"fp8 autopilot=true", "fp8 autopilot=false"}, list(rows)
    piloted, static = rows["fp8 autopilot=true"], rows["fp8 autopilot=false"]
    assert 0 < piloted["converted_flop_share"] < static["converted_flop_share"]
    assert piloted["final_loss"] < static["final_loss"]
    # its W&B run: the switches' table, and each step's share of FLOPs in fp8
    job = next(
        d
        for d in sweep.iterdir()
        if (d / "summary.json").exists()
        and json.loads((d / "summary.json").read_text()).get("autopilot")
    )
    (file,) = job.glob("wandb/offline-run-*/run-*.wandb")
    history = wandb_file.history(file)
    shares = {r["_step"]: r["low_flop_share"] for r in history if "low_flop_share" in r}
    assert len(shares) == 80 and shares[41] < shares[40]
    assert any(r.get("autopilot_switches/nrows") == 2 for r in history)  # its 2 switches
