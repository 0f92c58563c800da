"""Memory by category and dtype (exact, per job) and fp16 health (measured on the audited step,
with a recommendation)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from runner.config import GradScalerConfig
from runner.measure.health import LOW_ALARM, recommend
from runner.run import run
from runner.train import trainer
from tests.helpers import TINY_BERT, load_last, make_cfg, read_metrics

BATCH = 16


class TwoLinear(nn.Module):
    """8 → 16 → ReLU → 3: small enough to count what it saves for backward by hand."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def two_linear(precision: str, out, *overrides: str):
    cfg = make_cfg(
        "model=module",
        "model.net._target_=tests.test_memory_health.TwoLinear",
        "model.loss=mse",
        "dataset.train._target_=tests.test_own_model.pairs",
        "+dataset.train.regression=true",
        f"dataset.batch_size={BATCH}",
        f"precision={precision}",
        "trainer.max_steps=2",
        "trainer.progress_bar=false",
        "logger=none",
        *overrides,
    )
    return run(cfg, out)["memory"]


def test_activations_equal_a_count_by_hand_and_the_state_matches_the_optimizer(tmp_path):
    """fp32 saves the input (for the first weight's gradient), the ReLU output (for its own and
    the second weight's gradient), the prediction and the target (for the loss). bf16 autocast
    saves bf16 copies of the input, the ReLU output and the second weight (for the ReLU output's
    gradient; the input needs none, so the first weight's copy is not kept), and an fp32 copy of
    the prediction, where the loss runs in fp32."""
    fp32, bf16 = two_linear("fp32", tmp_path / "fp32"), two_linear("bf16", tmp_path / "bf16")
    mb = 2**20
    assert fp32["activations"]["by_dtype"] == {
        "float32": (BATCH * 8 + BATCH * 16 + BATCH * 3 + BATCH * 3) * 4 / mb
    }
    assert bf16["activations"]["by_dtype"] == {
        "bfloat16": (BATCH * 8 + BATCH * 16 + 3 * 16) * 2 / mb,
        "float32": (BATCH * 3 + BATCH * 3) * 4 / mb,
    }
    params = (8 * 16 + 16 + 16 * 3 + 3) * 4 / mb
    assert fp32["params"]["by_dtype"] == {"float32": params} == fp32["grads"]["by_dtype"]
    state = load_last(tmp_path / "fp32")["optimizer"]["state"]
    state_bytes = sum(v.numel() * v.element_size() for s in state.values() for v in s.values())
    assert fp32["optimizer"]["mb"] == pytest.approx(state_bytes / mb)
    assert fp32["masters"]["mb"] == 0 and fp32["peak"] is None  # a CPU run: the accounted total
    assert fp32["total"] == pytest.approx(
        sum(fp32[k]["mb"] for k in ("params", "grads", "optimizer", "masters", "activations"))
    )


def test_a_jobs_figures_do_not_depend_on_the_jobs_before_it(tmp_path):
    after_fp32 = (two_linear("fp32", tmp_path / "a"), two_linear("bf16", tmp_path / "b"))[1]
    first = two_linear("bf16", tmp_path / "c")
    two_linear("fp32", tmp_path / "d")
    assert after_fp32 == first


def test_bf16_saves_less_activation_memory_for_bert(tmp_path):
    """Between 0.4 and 0.75 of fp32's for a BERT whose body outweighs its head (the MLM head's
    fp32 log-softmax over the vocabulary is saved in both modes)."""
    sizes = [
        "model=bert",
        "model.hidden_size=64",
        "model.num_hidden_layers=2",
        "model.num_attention_heads=2",
        "model.intermediate_size=256",
        "model.dropout=0",
        "dataset.vocab_size=512",
        "dataset.num_documents=200",
        "dataset.seq_len=128",
        "dataset.batch_size=16",
        "trainer.max_steps=1",
        "trainer.progress_bar=false",
        "logger=none",
    ]
    saved = {
        p: run(make_cfg(*sizes, f"precision={p}"), tmp_path / p)["memory"]["activations"]["mb"]
        for p in ("fp32", "bf16")
    }
    assert 0.4 < saved["bf16"] / saved["fp32"] < 0.75, saved


def test_a_frozen_weight_is_a_parameter_not_an_activation(tmp_path):
    """Frozen, the second layer still saves its weight (for the ReLU output's gradient) and the
    ReLU output (for its own): fp32 saves what the trainable net saves, by hand above."""
    frozen = two_linear("fp32", tmp_path / "frozen", "model.freeze=[second]")
    trainable = two_linear("fp32", tmp_path / "trainable")
    assert frozen["activations"] == trainable["activations"]
    assert frozen["grads"]["mb"] == (8 * 16 + 16) * 4 / 2**20  # the second layer has none


class Blocks(nn.Module):
    """Four blocks FSDP shards one by one (gathered in bf16 under precision=bf16). Every weight
    has an even number of rows: FSDP pads an odd one's gathered copy to split it over 2 ranks."""

    def __init__(self):
        super().__init__()
        inner = [nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(2)]
        self.layers = nn.Sequential(nn.Linear(8, 32), *inner, nn.Linear(32, 4))

    def forward(self, x):
        return self.layers(x)


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_fsdp_saves_what_ddp_saves(tmp_path, mode):
    """Over 2 ranks, the full weights FSDP gathers for a forward are the parameters, not
    activations; gathered in bf16 they are the copies bf16 autocast makes under DDP."""
    from tests.test_distributed import run_ranks

    common = [
        "model=module",
        "model.net._target_=tests.test_memory_health.Blocks",
        "dataset.train._target_=tests.test_own_model.pairs",
        f"dataset.batch_size={BATCH}",
        f"precision={mode}",
        "trainer.max_steps=1",
        "trainer.progress_bar=false",
        "logger=none",
    ]
    strategies = ("ddp", "fsdp")
    run_ranks([([*common, f"trainer.strategy={s}"], tmp_path / s) for s in strategies])
    ddp, fsdp = (
        json.loads((tmp_path / s / "summary.json").read_text())["memory"] for s in strategies
    )
    assert fsdp["activations"] == ddp["activations"]
    assert fsdp["params"]["mb"] < ddp["params"]["mb"]  # each rank holds a shard of them


def test_fp16_health_finds_underflow_at_a_small_scale_and_none_at_the_default(tmp_path):
    cfg = [*TINY_BERT, "precision=fp16", "trainer.max_steps=3"]
    small = run(make_cfg(*cfg, "precision.grad_scaler.init_scale=1"), tmp_path / "s")
    default = run(make_cfg(*cfg), tmp_path / "d")
    health, fine = small["fp16_health"], default["fp16_health"]
    assert health["underflow_share_unscaled"] > 0
    assert health["underflow_share_scaled"] + health["subnormal_share"] > 10 * LOW_ALARM
    assert health["recommendation"].startswith("raise precision.grad_scaler.init_scale to ")
    assert fine["underflow_share_scaled"] + fine["subnormal_share"] < LOW_ALARM
    assert fine["underflow_share_unscaled"] == health["underflow_share_unscaled"]
    assert fine["recommendation"].startswith("ok")
    assert 0 < fine["activation_headroom_log2"] < 16 and fine["scale_min"] == 65536
    assert "fp16_health" not in run(make_cfg(*TINY_BERT, "trainer.max_steps=1"), tmp_path / "f")


def test_fp16_health_measures_without_changing_the_run(tmp_path, monkeypatch):
    """The reference backward puts the RNG and buffers back: with dropout, the run's losses are
    those of the same run with the measurement left out."""
    cfg = make_cfg(*TINY_BERT, "model.dropout=0.1", "trainer.max_steps=3", "precision=fp16")
    measured = run(cfg, tmp_path / "measured")
    monkeypatch.setattr(trainer, "window_health", lambda *health: None)
    plain = run(cfg, tmp_path / "plain")
    assert measured["fp16_health"]["underflow_share_unscaled"] is not None
    assert plain["fp16_health"]["underflow_share_unscaled"] is None
    numbers = ("loss", "grad_norm", "loss_scale")
    assert [[r[k] for k in numbers] for r in read_metrics(tmp_path / "measured")] == [
        [r[k] for k in numbers] for r in read_metrics(tmp_path / "plain")
    ]


@pytest.mark.parametrize(
    "history, advice",
    [
        ({"skipped_steps": 5, "steps": 20, "scale_min": 0.25}, "use bf16"),
        ({"scale_backoffs": 8, "steps": 20}, "raise precision.grad_scaler.growth_interval"),
        (
            {"skipped_steps": 6, "leading_skipped_steps": 6, "scale_final": 1024.0},
            "lower precision.grad_scaler.init_scale",
        ),
        ({}, "ok"),
    ],
)
def test_the_scale_history_decides_the_advice_when_the_gradient_is_fine(history, advice):
    base = {"skipped_steps": 0, "steps": 20, "scale_min": 65536.0, "scale_final": 65536.0}
    base |= {"scale_backoffs": 0, "leading_skipped_steps": 0} | history
    assert recommend({}, base, GradScalerConfig()).startswith(advice)


def test_the_memory_saving_uses_the_measured_peak_on_cuda_and_the_accounted_total_on_a_cpu():
    from runner.compare.groups import memory_figure

    cuda = {"memory": {"total": 10.0, "peak": 14.0}, "peak_memory_mb": 14.0}
    cpu = {"memory": {"total": 10.0, "peak": None}, "peak_memory_mb": 900.0}
    assert memory_figure(cuda) == (14.0, "measured peak")
    assert memory_figure(cpu) == (10.0, "accounted total")
    assert memory_figure({"peak_memory_mb": 900.0}) == (900.0, "process peak")
