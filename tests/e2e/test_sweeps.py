"""Sweeps through the real CLI: W&B runs grouped per sweep, launchers, the comparison at the end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from runner import wandb_file
from tests.helpers import cli, module_run, read_metrics

pytestmark = pytest.mark.slow
MLP = [
    "model=mlp",
    "dataset.num_samples=1024",
    "trainer.max_steps=12",
    "trainer.progress_bar=false",
]


def _wandb_run(job_dir):
    files = list(job_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    records = wandb_file.records(files[0])
    run = next(r.run for r in records if r.HasField("run"))
    history = wandb_file.history(files[0])
    summary = {}
    for r in records:
        if r.HasField("summary"):
            for item in r.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    return run, history, summary, config


def test_precision_sweep_logs_one_grouped_wandb_run_per_job_and_compares(tmp_path):
    sweep = tmp_path / "multirun" / "a"
    proc = cli("-m", "precision=fp32,fp16,bf16", *MLP, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    runs = [_wandb_run(sweep / str(i)) for i in range(3)]
    assert {r.run_group for r, *_ in runs} == {"multirun-a"}
    assert [r.display_name for r, *_ in runs] == ["mlp-fp32", "mlp-fp16", "mlp-bf16"]
    for i, (_, history, summary, config) in enumerate(runs):
        assert config["precision"]["mode"] == ["fp32", "fp16", "bf16"][i]
        assert config["trainer"]["max_steps"] == 12 and config["choices"]["model"] == "mlp"
        rows = read_metrics(sweep / str(i))
        assert [h["step"] for h in history] == [r["step"] for r in rows]
        assert [h["loss"] for h in history] == pytest.approx([r["loss"] for r in rows])
        assert {
            "grad_norm",
            "loss_scale",
            "skipped",
            "skipped_total",
            "lr",
            "samples_per_s",
        } <= set(history[0])
        assert summary["skipped_steps"] == 0 and summary["precision"] == config["precision"]["mode"]
        # the precision manifest as a W&B table, at the last step
        assert history[-1]["precision_manifest/_type"] == "table-file"
    assert "wandb sync" in proc.stderr
    report = json.loads((sweep / "compare.json").read_text())
    assert [r["precision"] for r in report] == ["fp32", "fp16", "bf16"]
    assert (sweep / "compare.png").stat().st_size > 10_000 and "verdict" in proc.stdout
    # The comparison is logged to the sweep's group too.
    compare_runs = list(sweep.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(compare_runs) == 1
    records = wandb_file.records(compare_runs[0])
    run = next(r.run for r in records if r.HasField("run"))
    assert run.run_group == "multirun-a" and run.job_type == "compare"

    second = tmp_path / "multirun" / "b"
    proc = cli("-m", "precision=fp32,bf16", *MLP, f"hydra.sweep.dir={second}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _wandb_run(second / "0")[0].run_group == "multirun-b"


def test_single_run_has_no_group_and_a_name(tmp_path):
    out = tmp_path / "run"
    proc = cli("precision=bf16", *MLP, f"hydra.run.dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run, *_ = _wandb_run(out)
    assert run.run_group == "" and run.display_name == "mlp-bf16"


def test_jobs_are_labelled_by_the_overrides_the_sweep_varies(tmp_path):
    sweep = tmp_path / "sweep"
    proc = cli(
        "-m",
        "precision=fp32,bf16",
        *MLP,
        "trainer.max_steps=3,4",
        "logger=none",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    labels = [r["label"] for r in json.loads((sweep / "compare.json").read_text())]
    assert labels == [
        "fp32 max_steps=3",
        "fp32 max_steps=4",
        "bf16 max_steps=3",
        "bf16 max_steps=4",
    ]


def test_a_failed_job_does_not_stop_the_sweep_but_fails_the_command(tmp_path):
    """Job 0 fails when its model is built: its net cannot take the data's 8 features, which
    only a batch through it shows (a bad value, a device that does not exist, a key nothing
    takes, are refused for every job before the first starts: tests/test_hostile.py)."""
    sweep = tmp_path / "sweep"
    proc = cli(
        "-m",
        *module_run("torch.nn.Linear", "+model.net.in_features=5,8", "+model.net.out_features=3"),
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])},  # tests.*
    )
    assert proc.returncode == 1
    assert "error: job 0 failed: model.net (torch.nn.Linear) cannot take" in proc.stderr
    assert "Traceback" not in proc.stderr
    report = json.loads((sweep / "compare.json").read_text())
    assert [r["status"] for r in report] == ["failed", "completed"]
    assert report[0]["verdict"].startswith("failed: model.net (torch.nn.Linear) cannot take")
    assert len(read_metrics(sweep / "1")) == 2


@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
def test_parallel_and_submitit_launchers(tmp_path, launcher):
    sweep = tmp_path / "sweep"
    extra = (
        ["hydra.launcher.n_jobs=2"] if launcher == "joblib" else ["hydra.launcher.timeout_min=10"]
    )
    proc = cli(
        "-m",
        f"hydra/launcher={launcher}",
        *extra,
        "precision=fp32,bf16",
        *MLP,
        "logger=none",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    summaries = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in range(2)]
    assert [s["precision"] for s in summaries] == ["fp32", "bf16"]
    assert all(s["status"] == "completed" and s["steps"] == 12 for s in summaries)
    assert (sweep / "compare.md").exists()


def test_amp_check_runs_the_50_step_check_in_each_precision(tmp_path):
    sweep = tmp_path / "check"
    proc = cli(
        "experiment=amp_check",
        "model=mlp",
        "dataset.num_samples=1024",
        "logger=none",
        "trainer.progress_bar=false",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((sweep / "compare.json").read_text())
    assert [r["precision"] for r in report] == ["fp32", "fp16", "bf16"]
    assert all(r["steps"] == 50 for r in report)
    first_losses = {read_metrics(sweep / str(i))[0]["loss"] for i in range(3)}
    assert max(first_losses) - min(first_losses) < 0.05  # same seed, weights and data order


def test_an_unreachable_wandb_is_a_warning_and_loses_no_metric(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_API_KEY")}
    env["HOME"] = str(tmp_path / "home")  # no credentials anywhere
    out = tmp_path / "run"
    args = [*MLP, "logger.mode=online", "logger.init_timeout_s=20", f"hydra.run.dir={out}"]
    proc = cli(*args, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "warning: W&B did not start" in proc.stderr
    assert len(read_metrics(out)) == 12
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
