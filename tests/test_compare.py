"""The comparison report: figures against fp32, verdicts, failed and diverged jobs, bad input."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.compare import compare
from runner.errors import UserError
from runner.run import run
from tests.helpers import TINY_MLP, make_cfg


def run_job(folder: Path, *overrides: str) -> None:
    """One job of a sweep, with the .hydra/ record Hydra writes for it."""
    cfg = make_cfg(*TINY_MLP, "trainer.max_steps=20", *overrides)
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create(list(overrides)), folder / ".hydra" / "overrides.yaml")
    try:
        run(cfg, folder)
    except UserError:
        pass  # a failed job: its summary.json says why


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    run_job(root / "0", "precision=fp32")
    run_job(root / "1", "precision=bf16")
    run_job(root / "2", "precision=fp16", "precision.grad_scaler.init_scale=1e30")  # skips them all
    run_job(
        root / "3", "precision=fp32", "optim.optimizer.lr=1e5", "trainer.gradient_clip_val=null"
    )
    run_job(root / "4", "precision=bf16", "trainer.device=cuda:7")  # fails: no such device
    return root


def test_every_job_gets_a_row_and_an_honest_verdict(sweep):
    jobs = {j.folder.name: j for j in compare(sweep, wandb_log=False)}
    assert jobs["0"].verdict.startswith("baseline")
    assert jobs["0"].figures["speedup"] == pytest.approx(1.0)
    bf16 = jobs["1"]
    assert bf16.figures["max_loss_gap"] < 0.05 and "of fp32" in bf16.verdict
    assert bf16.figures["speedup"] == pytest.approx(
        bf16.summary["samples_per_s"] / jobs["0"].summary["samples_per_s"]
    )
    assert jobs["2"].verdict == "overflowed: 20 of 20 steps skipped — not recommended"
    assert jobs["3"].verdict.startswith("diverged")
    assert jobs["4"].verdict.startswith("failed: trainer.device=cuda:7 but ")
    assert (
        sum(
            "recommended" in j.verdict and "not recommended" not in j.verdict for j in jobs.values()
        )
        == 1
    )


def test_report_files_are_written(sweep):
    compare(sweep, wandb_log=False)
    rows = list(csv.reader(open(sweep / "compare.csv")))
    assert rows[0][:3] == ["precision", "samples/s", "speedup"] and len(rows) == 6
    records = json.loads((sweep / "compare.json").read_text())
    assert [r["status"] for r in records] == ["completed"] * 4 + ["failed"]
    assert "| precision |" in (sweep / "compare.md").read_text()
    png = (sweep / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(sweep / "compare.png").shape
    assert width > 400 and height > 300


def test_empty_or_mixed_folders_are_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="no runs in"):
        compare(tmp_path, wandb_log=False)
    run_job(tmp_path / "0", "precision=fp32")
    run_job(tmp_path / "1", "precision=bf16", "model.hidden_size=16")
    with pytest.raises(UserError, match="mixes runs of different models"):
        compare(tmp_path, wandb_log=False)
    proc = subprocess.run(
        [sys.executable, "-m", "runner.compare", str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: compare:")
    assert "Traceback" not in proc.stderr
