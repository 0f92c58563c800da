"""`runner.seeds=auto` through the real cluster's launchers: the sweep of
tests/e2e/test_seeds_auto.py, each of its rounds a multirun submitted to SLURM (`+launcher=slurm`)
or run on the Ray head (`+launcher=ray`), in the same sweep folder. bf16_true is decided worse at
3 seeds; bf16 runs to the cap (4) with fp32 beside it; the second round's jobs are in folders
seed3-0 and seed3-1 and ran fp32 and bf16 only. A second-round job cancelled on SLURM is named
CANCELLED, and the same command runs it again, alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.test_seeds_auto import AUTO, assert_second_round

from .conftest import finish, wait_until

pytestmark = pytest.mark.cluster

SLURM = [
    "+launcher=slurm",
    "hydra.launcher.gpus_per_node=0",  # the partition has no GPU
    "hydra.launcher.cpus_per_task=1",  # two jobs at once on the node's 2 CPUs
    "hydra.launcher.mem_gb=1",
]
QUIET = {"WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def run_sweep(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runner", "-m", *args, *AUTO],
        cwd=cwd,
        env={**env, **QUIET},
        capture_output=True,
        text=True,
        timeout=900,
    )


def assert_auto_sweep(proc: subprocess.CompletedProcess, sweep: Path, first: bool = True) -> None:
    """What tests/e2e/test_seeds_auto.py asserts of the basic launcher's sweep."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["label"]: r for r in json.loads((sweep / "compare.json").read_text())}
    assert {k: r["seeds"] for k, r in rows.items()} == {"fp32": 4, "bf16_true": 3, "bf16": 4}
    assert {k: r["status"] for k, r in rows.items()} == dict.fromkeys(rows, "completed")
    assert rows["bf16_true"]["seeds_stopped"] == "decided"
    assert rows["bf16_true"]["verdict"].startswith("worse than fp32")
    assert rows["bf16"]["seeds_stopped"] == (
        "the cap, runner.max_seeds=4: its loss gap interval still open"
    )
    assert rows["fp32"]["seeds_stopped"] == "the baseline"
    assert "paired over 4 seeds" in rows["bf16"]["verdict"]
    # The first round in folders 0..8, the second in folders of its own: fp32 and bf16, seed 3.
    for folder in assert_second_round(sweep):
        assert json.loads((sweep / folder / "summary.json").read_text())["status"] == "completed"
    md = (sweep / "compare.md").read_text()
    assert "| 4: the cap, runner.max_seeds=4: its loss gap interval still open |" in md
    assert "| 3: decided |" in md and "loss gap [99.38% CI]" in md
    if first:  # the first look said why a round followed (a rerun reads it back)
        assert "seeds=auto: bf16 (3 seeds): undecided: its loss gap interval still open" in (
            proc.stderr
        )


def test_seeds_auto_on_slurm_submits_each_round_to_the_cluster(slurm, tmp_path):
    """Each round one SLURM array (9 jobs, then 2), two 1-CPU jobs at a time on the node."""
    name = f"amp-test-{uuid.uuid4().hex[:8]}"
    sweep = tmp_path / "sweep"
    try:
        proc = run_sweep(
            [*SLURM, f"hydra.launcher.name={name}", f"hydra.sweep.dir={sweep}"],
            slurm.env,
            tmp_path,
        )
    finally:
        slurm.run("scancel", "-n", name, check=False)
    assert_auto_sweep(proc, sweep)
    # Every job of both rounds ran on the cluster: 11 SLURM jobs, the last two the second round's.
    submitted = [line for line in proc.stderr.splitlines() if ": SLURM job " in line]
    assert len([s for s in submitted if s.endswith(tuple("0123456789"))]) == 11, proc.stderr
    listed = slurm.run(
        "sacct", "-n", "-X", "-P", "-S", "now-2hours", "--name", name, "-o", "JobID,State"
    )
    states = [line.split("|")[1] for line in listed.stdout.split()]
    assert states == ["COMPLETED"] * 11, listed.stdout
    for folder in ("seed3-0", "seed3-1"):
        assert (sweep / folder / "summary.json").exists()
        assert json.loads((sweep / folder / "launcher.json").read_text())["state"] == "COMPLETED"


def test_seeds_auto_on_ray_runs_each_round_on_the_head(ray_head, cluster_env, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="the `ray` extra is missing")
    proc = run_sweep(
        ["+launcher=ray", "hydra.sweep.dir=sweep"],  # relative: to this folder, not the workers'
        {**os.environ, **cluster_env},
        tmp_path,
    )
    assert_auto_sweep(proc, tmp_path / "sweep")
    assert proc.stderr.count(": on Ray") == 11, proc.stderr


@dataclass
class Cancelled:
    """An auto sweep on SLURM whose second round's bf16 job was cancelled as soon as it was
    submitted (still pending, as a rule: an array task none of whose tasks had started)."""

    args: list[str]
    sweep: Path
    job: str
    returncode: int
    out: str


@pytest.fixture(scope="module")
def cancelled(slurm, tmp_path_factory) -> Iterator[Cancelled]:
    tmp = tmp_path_factory.mktemp("cancelled")
    name = f"amp-test-{uuid.uuid4().hex[:8]}"
    sweep, log = tmp / "sweep", tmp / "sweep.log"
    args = [*SLURM, f"hydra.launcher.name={name}", f"hydra.sweep.dir={sweep}"]
    env = {**slurm.env, **QUIET}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runner", "-m", *args, *AUTO],
            cwd=tmp,
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        second = r"^#1 precision=bf16: SLURM job (\d+_1)$"  # round 1's labels carry seed=
        found = wait_until(
            lambda: re.search(second, log.read_text(), re.M), 300, "the second round's bf16 job"
        )
        slurm.run("scancel", found[1])
        out = finish(proc, log)
        yield Cancelled(args, sweep, found[1], proc.returncode, out)
    finally:
        slurm.run("scancel", "-n", name, check=False)


def test_seeds_auto_on_slurm_a_second_round_job_cancelled_is_named(cancelled):
    """Named CANCELLED, by the sweep and in the comparison (a pending array task cancelled
    leaves the queue without a state and is never in accounting: it was named PENDING)."""
    job, out = cancelled.job, cancelled.out
    assert cancelled.returncode == 1, out[-3000:]
    assert f"#1 precision=bf16: SLURM job {job} CANCELLED" in out, out[-3000:]
    assert f"#seed3-1 bf16: SLURM job {job} CANCELLED" in out
    assert "complete it: run the same command" in out
    record = json.loads((cancelled.sweep / "seed3-1" / "launcher.json").read_text())
    assert record["state"] == "CANCELLED"
    assert f"failed: SLURM job {job} CANCELLED" in (cancelled.sweep / "compare.md").read_text()


def test_seeds_auto_on_slurm_the_same_command_completes_a_cancelled_second_round(slurm, cancelled):
    """What the sweep said to do: the same command, which should submit the cancelled job alone
    (everything else read back) and end as the sweep that was not cancelled."""
    rerun = run_sweep(cancelled.args, slurm.env, cancelled.sweep.parent)
    # the unfinished round runs again a command line a job, each into its own folder: only
    # the cancelled one is submitted (its line sets one precision, so its label names none)
    submitted = re.findall(r"^(#\d+.*): SLURM job \d+(?:_\d+)?$", rerun.stderr, re.M)
    assert len(submitted) == 1, rerun.stderr[-3000:]
    again = json.loads((cancelled.sweep / "seed3-1" / "summary.json").read_text())
    assert again["precision"] == "bf16", again
    assert_auto_sweep(rerun, cancelled.sweep, first=False)
