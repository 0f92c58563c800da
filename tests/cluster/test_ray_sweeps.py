"""Sweeps on the real Ray head of scripts/cluster.sh through `+launcher=ray`, as a user attached
to a running cluster runs them: no override needed, the sweep written where the command reads it,
each job's W&B run named by its swept values."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from runner import wandb_file

pytestmark = pytest.mark.cluster


def test_a_sweep_attached_to_a_running_head_is_compared_where_the_user_looks(
    ray_head, cluster_env, tmp_path
):
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="the `ray` extra is missing")
    env = {**os.environ, **cluster_env, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner",
            "-m",
            "+launcher=ray",
            "model=mlp",
            "precision=fp32",
            "runner.seeds=2",
            "trainer.max_steps=8",
            "trainer.progress_bar=false",
            "logger=wandb",
            "hydra.sweep.dir=sweeps/attached",  # relative: to this folder, not the workers'
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = tmp_path / "sweeps" / "attached"
    assert (sweep / "compare.md").is_file()
    names = set()
    for job in ("0", "1"):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["status"] == "completed"
        (path,) = (sweep / job).glob("wandb/offline-run-*/run-*.wandb")
        run = next(r.run for r in wandb_file.records(path) if r.HasField("run"))
        assert run.run_group == "sweeps-attached"
        names.add(run.display_name)
    assert names == {"mlp-fp32-seed=0", "mlp-fp32-seed=1"}
