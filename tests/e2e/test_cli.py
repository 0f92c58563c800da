"""The real command line, in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers import TINY_BERT, TINY_MLP, cli, read_metrics

pytestmark = pytest.mark.slow

# What other code writes to stderr: torch's logging (W1201 20:59:23.167000 ... file.py:630]),
# Python's warnings (file.py:12: UserWarning: ...), tracebacks, a library's own bare log lines.
FOREIGN = re.compile(r"^[IWEF]\d{4} \d\d:|\w+Warning: |Traceback|site-packages|^Failed to load")


def test_main_command_writes_every_run_output(tmp_path):
    out = tmp_path / "run"
    proc = cli(
        "precision=bf16", *TINY_BERT, "trainer.max_steps=6", f"hydra.run.dir={out}", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "precision: bf16" in proc.stderr
    assert "amp-runner summary" in proc.stdout and " loss " in proc.stdout
    assert "None" not in proc.stdout and len(proc.stdout.splitlines()) < 25
    assert len(read_metrics(out)) == 6
    summary = json.loads((out / "summary.json").read_text())
    assert summary["precision"] == "bf16" and summary["steps"] == 6
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert state["step"] == 6 and state["scaler"] is None
    assert (out / ".hydra" / "config.yaml").exists()
    assert "precision=bf16" in (out / ".hydra" / "overrides.yaml").read_text()


def test_stderr_holds_only_the_projects_lines(tmp_path):
    """torchao's loader noise (transformers imports it) goes to the run's log file, not the
    console: a run writes only the project's lines, a refused one its one error line."""
    out = tmp_path / "run"
    good = cli(
        *TINY_BERT, "logger=wandb", "trainer.max_steps=2", f"hydra.run.dir={out}", cwd=tmp_path
    )
    assert good.returncode == 0, good.stderr
    assert [line for line in good.stderr.splitlines() if FOREIGN.search(line)] == []
    assert good.stderr.startswith("precision: fp32")
    bad = cli(*TINY_BERT, "++model.hidden_sise=32", cwd=tmp_path)  # refused after the import
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == [bad.stderr.strip()]
    assert bad.stderr.startswith("error: model.hidden_sise is not a key")


def test_sweep_runs_every_precision_in_one_process_without_leaks(tmp_path):
    sweep = tmp_path / "sweep"
    proc = cli(
        "-m",
        "precision=tf32,fp32,fp16,bf16",
        *TINY_BERT,
        "trainer.max_steps=4",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "summary.json").exists())
    summaries = [json.loads((j / "summary.json").read_text()) for j in jobs]
    assert [s["precision"] for s in summaries] == ["tf32", "fp32", "fp16", "bf16"]
    for job, s in zip(jobs, summaries, strict=True):
        assert s["steps"] == 4 and len(read_metrics(job)) == 4
        scaler = torch.load(job / "checkpoints" / "last.pt", weights_only=True)["scaler"]
        assert (scaler is not None) == (s["precision"] == "fp16")
    # Same seed and data: the fp32 job after a tf32 job starts from the same loss as tf32's.
    first = [read_metrics(j)[0]["loss"] for j in jobs]
    assert first[0] == pytest.approx(first[1], rel=1e-3)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["precision=fp4"],
            "error: unknown precision 'fp4': choose from auto, bf16, bf16_true, fp16, fp16_master, "
            "fp32, fp8, mxfp4, mxfp8, nvfp4, staged, tf32",
        ),
        (["model=resnet9"], "error: unknown model 'resnet9'"),
        (
            ["trainer.accumulate_grad_batches=0"],
            "error: trainer.accumulate_grad_batches=0 is invalid",
        ),
        (["trainer.gradient_clip_val=-0.5"], "error: trainer.gradient_clip_val=-0.5 is invalid"),
        (["trainer.max_steps=0"], "error: trainer.max_steps=0 is invalid"),
        (
            ["dataset=text_files", "dataset.data_files=/no/such/corpus.txt"],
            "error: dataset.data_files: no file found at '/no/such/corpus.txt'",
        ),
        (["trainer.device=cuda"], "error: trainer.device=cuda but CUDA is not available here"),
        (
            ["optim.optimizer.lr=abc"],
            "error: optim.optimizer.lr='abc' is invalid: must be a number",
        ),
        (["optim.optimizer.betas=5"], "error: optim.optimizer.betas=5 is invalid: must be a list"),
        # A task-owned group's documented keys are checked in preflight too.
        (
            [*TINY_MLP, "trainer.max_steps=2", "model.hidden_size=abc"],
            "error: model.hidden_size='abc' is invalid: must be an integer ≥ 1",
        ),
    ],
)
def test_bad_input_is_one_line_and_a_nonzero_exit(tmp_path, args, message):
    if "cuda" in " ".join(args) and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = cli(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [errors[0]] and errors[0].startswith(message)
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_bad_optimizer_value_in_a_sweep_fails_before_any_job_runs(tmp_path):
    sweep = tmp_path / "sweep"
    proc = cli(
        "-m",
        "optim.optimizer.lr=1e-3,abc",  # the good job first: it must not run either
        *TINY_MLP,
        "trainer.max_steps=2",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: optim.optimizer.lr='abc' is invalid: must be a number > 0"]
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_doctor_reports_every_mode_and_a_recommendation(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "runner.doctor"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"torch {torch.__version__}" in proc.stdout
    for mode in ("fp32", "tf32", "fp16", "bf16"):
        assert f"│ {mode} " in proc.stdout
    assert "recommended:" in proc.stdout and "(measured)" in proc.stdout
