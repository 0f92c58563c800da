"""Sweeps on the real Ray head of scripts/cluster.sh through `+launcher=ray`, as a user attached
to a running cluster runs them: no override needed, the sweep written where the command reads it,
each job's W&B run named by its swept values."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runner import wandb_file

from .conftest import wait_until

pytestmark = pytest.mark.cluster
SWEEP = [sys.executable, "-m", "runner", "-m", "+launcher=ray", "model=mlp", "precision=fp32"]


def test_a_sweep_attached_to_a_running_head_is_compared_where_the_user_looks(
    ray_head, cluster_env, tmp_path
):
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="the `ray` extra is missing")
    env = {**os.environ, **cluster_env, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [
            *SWEEP,
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


def ray_job_processes() -> list[int]:
    """The pids of Ray workers running a sweep job (Ray titles them after the task)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(b"ray::_run_job"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_a_job_ray_loses_is_named_and_the_same_command_completes_the_sweep(
    ray_head, cluster_env, tmp_path
):
    """A worker killed mid-job (as out-of-memory or a lost node ends it), Ray retrying no more: the other job's
    comparison is written, the lost one named, the exit non-zero; the same command reruns only
    the lost job, from its last checkpoint."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="the `ray` extra is missing")
    env = {**os.environ, **cluster_env, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    command = [
        *SWEEP,
        "seed=0,1",
        "trainer.max_steps=3000",
        "trainer.checkpoint_every_n_steps=50",
        "trainer.val_check_interval=1000",
        "trainer.progress_bar=false",
        "logger=none",
        "hydra.sweep.dir=sweep",
        # Ray runs a task whose worker died again (3 times by default; the job then resumes
        # from its checkpoint): here it gives up at once, as after its last retry
        "+hydra.launcher.ray.remote.max_retries=0",
    ]
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_until(
            lambda: all(
                (sweep / j / "metrics.jsonl").exists()
                and len((sweep / j / "metrics.jsonl").read_text().splitlines()) >= 60
                for j in ("0", "1")
            ),
            120,
            "both jobs train past a checkpoint",
        )
        os.kill(wait_until(ray_job_processes, 30, "a Ray worker running a job")[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode != 0, out[-3000:]
    assert (sweep / "compare.md").is_file()
    lost = [
        j
        for j in ("0", "1")
        if not (sweep / j / "summary.json").exists()
        or json.loads((sweep / j / "summary.json").read_text())["status"] != "completed"
    ]
    assert len(lost) == 1, out[-3000:]
    assert "lost by Ray" in out and "lost by Ray" in (sweep / "compare.md").read_text()
    rerun = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "read back, not run again" in rerun.stderr
    for j in ("0", "1"):
        assert json.loads((sweep / j / "summary.json").read_text())["status"] == "completed"
