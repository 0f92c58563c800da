"""fp16 health speaks of the loss-scaled steps the run ran, and never calls a loss scale that
skipped steps one that suits the model."""

from __future__ import annotations

import json

import pytest
from torch import nn

from runner.config import GradScalerConfig
from runner.measure.health import recommend
from runner.run import run
from tests.helpers import make_cfg, read_metrics

COMMON = [
    "model=module",
    "dataset.train._target_=tests.test_own_model.pairs",
    "dataset.batch_size=16",
    "trainer.progress_bar=false",
    "logger=none",
    "trainer.val_check_interval=0",
]


class BatchNormNet(nn.Module):
    """8 → 64 → BatchNorm → ReLU → 3: its largest gradient leaves fp16's range at a scale near
    2^18, so a run at 2^20 skips its first steps."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Linear(8, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 3)
        )

    def forward(self, x):
        return self.blocks(x)


def fp16_run(out, *overrides: str) -> tuple[dict, list[dict]]:
    cfg = make_cfg(
        *COMMON,
        "model.net._target_=tests.test_fp16_health.BatchNormNet",
        "precision=fp16",
        "trainer.max_steps=4",
        *overrides,
    )
    return run(cfg, out), read_metrics(out)


def test_a_bf16_run_resumed_from_an_fp16_master_checkpoint_has_no_fp16_health(tmp_path, capsys):
    """The earlier job's loss-scaled steps are in the run's rows, but this run's precision
    scales no loss: it says nothing of fp16."""
    net = "model.net._target_=tests.test_own_model.Net"
    run(make_cfg(*COMMON, net, "precision=fp16_master", "trainer.max_steps=2"), tmp_path)
    capsys.readouterr()
    resumed = make_cfg(
        *COMMON,
        net,
        "precision=bf16",
        "trainer.max_steps=4",
        "trainer.resume=auto",
        "trainer.resume_across_precision=true",  # fp16_master's masters into bf16's fp32 weights
    )
    run(resumed, tmp_path)
    assert [r["precision"] for r in read_metrics(tmp_path)] == ["fp16_master"] * 2 + ["bf16"] * 2
    assert "fp16_health" not in json.loads((tmp_path / "summary.json").read_text())
    assert "fp16 health" not in capsys.readouterr().err


def test_skipped_steps_are_named_in_the_advice_not_called_ok(tmp_path):
    summary, rows = fp16_run(tmp_path, "precision.grad_scaler.init_scale=1048576")
    skipped = sum(r["skipped"] for r in rows)
    assert 0 < skipped < len(rows) == 4  # steps with non-finite gradients, skipped, then some ran
    advice = summary["fp16_health"]["recommendation"]
    assert not advice.startswith("ok") and f"{skipped} of 4 steps were skipped" in advice
    # The measured largest gradient bounds the scale to lower to, ×2 spare, below the overflow.
    assert advice.startswith("lower precision.grad_scaler.init_scale to ")
    ceiling = float(advice.removeprefix("lower precision.grad_scaler.init_scale to ").split(":")[0])
    assert ceiling < min(r["loss_scale"] for r in rows if r["skipped"])


def test_a_scale_past_every_gradient_skips_every_step_and_says_so(tmp_path):
    """(init_scale=inf itself is refused before the run: tests/test_hostile.py.)"""
    summary, rows = fp16_run(tmp_path, "precision.grad_scaler.init_scale=1e38")
    assert all(r["skipped"] for r in rows) and len(rows) == 4
    advice = summary["fp16_health"]["recommendation"]
    assert advice.startswith("lower precision.grad_scaler.init_scale to ")
    assert "every one of the 4 loss-scaled steps was skipped" in advice


BASE = {
    "skipped_steps": 0,
    "leading_skipped_steps": 0,
    "steps": 20,
    "scale_min": 65536.0,
    "scale_final": 65536.0,
    "scale_backoffs": 0,
}


@pytest.mark.parametrize(
    "health, history, advice",
    [
        # Skipped mid-run, the scale back where it began: said, not "ok".
        ({}, {"skipped_steps": 2, "scale_min": 32768.0}, "2 of 20 steps were skipped"),
        # Every step skipped, no fp32 reference (fp16_master, FSDP): nothing trained.
        ({}, {"skipped_steps": 20, "leading_skipped_steps": 20}, "lower precision.grad_scaler"),
        # The largest gradient leaves fp16 at 2^10.5: scales above 2^9 skip steps.
        (
            {"gradient_headroom_log2": 10.5},
            {"skipped_steps": 1, "scale_min": 32768.0},
            "lower precision.grad_scaler.init_scale to 512: 1 of 20 steps",
        ),
        ({}, {}, "ok: the loss scale suits this model"),
    ],
)
def test_the_advice_names_skipped_steps(health, history, advice):
    assert recommend(health, BASE | history, GradScalerConfig()).startswith(advice)
