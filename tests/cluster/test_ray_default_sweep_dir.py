"""Issue 51: the Ray sweep as a user types it first, attached to a running head from a plain
folder and without `hydra.sweep.dir`, writes where the command without the launcher would
(multirun/DATE/TIME under the folder it is typed in) and makes the comparison. It ended in
`InterpolationResolutionError: HydraConfig was not set, full_key: hydra.sweep.dir` before
(runner/launch/context.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster

COMMAND = (
    "python -m runner -m +launcher=ray model=mlp precision=fp32,bf16 runner.seeds=2 "
    "runner.speed=interleaved trainer.max_steps=20"
)


def test_the_ray_sweep_without_a_sweep_dir_writes_where_the_plain_sweep_would(
    ray_head, cluster_env, tmp_path
):
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="the `ray` extra is missing")
    env = {**os.environ, **cluster_env, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    env["PATH"] = f"{os.path.dirname(sys.executable)}:{env['PATH']}"  # `python`: this venv's
    proc = subprocess.run(
        COMMAND, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HydraConfig was not set" not in proc.stderr
    (sweep,) = (tmp_path / "multirun").glob("*/*")  # multirun/DATE/TIME, as without +launcher
    for job in ("0", "1", "2", "3"):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["steps"] == 20
    rows = json.loads((sweep / "compare.json").read_text())
    assert sorted(r["precision"] for r in rows) == ["bf16", "fp32"]
    assert {r["speed_source"] for r in rows} == {"interleaved"}, rows
    assert proc.stdout.count("precision comparison") == 1
    assert (sweep / "compare.md").is_file()
