"""FLOPs, MFU and the precision audit: which dtype each op really ran in."""

from __future__ import annotations

import pytest

from runner.precision import DeviceCaps
from runner.run import run
from runner.telemetry import peak_tflops
from tests.helpers import TINY_BERT, TINY_MLP, make_cfg, read_metrics

STEP = ["trainer.max_steps=3", "trainer.val_check_interval=0"]


def test_flops_per_step_match_the_arithmetic_of_an_mlp(tmp_path):
    summary = run(make_cfg(*TINY_MLP, *STEP, "model.hidden_size=48"), tmp_path)
    batch, dims = 64, [32, 48, 48, 8]  # features → hidden → hidden → classes
    matmuls = [a * b for a, b in zip(dims, dims[1:], strict=False)]
    forward = 2 * batch * sum(matmuls)
    weight_grads = 2 * batch * sum(matmuls)
    input_grads = 2 * batch * sum(matmuls[1:])  # the first layer's input needs no gradient
    assert summary["flops_per_step"] == forward + weight_grads + input_grads


def test_the_audit_tells_low_precision_from_fp32(tmp_path):
    fp32 = run(make_cfg(*TINY_BERT, *STEP, "precision=fp32"), tmp_path / "fp32")
    bf16 = run(make_cfg(*TINY_BERT, *STEP, "precision=bf16"), tmp_path / "bf16")
    assert fp32["flops_per_step"] == bf16["flops_per_step"] > 0
    assert fp32["low_precision_flop_share"] == 0
    assert sum(fp32["fp32_ops"].values()) == fp32["flops_per_step"]
    assert bf16["low_precision_flop_share"] > 0.5
    assert "addmm" not in bf16["fp32_ops"]  # every Linear ran in bf16


def test_fp32_islands_show_up_in_the_audit(tmp_path):
    plain = run(make_cfg(*TINY_MLP, *STEP, "precision=bf16"), tmp_path / "plain")
    island = run(
        make_cfg(*TINY_MLP, *STEP, "precision=bf16", "precision.fp32_modules=[net.0]"),
        tmp_path / "island",
    )
    assert plain["low_precision_flop_share"] == 1.0 and plain["fp32_ops"] == {}
    assert 0 < island["low_precision_flop_share"] < 1
    assert island["fp32_ops"]["addmm"] > 0


def test_mfu_is_achieved_over_peak(tmp_path):
    s = run(make_cfg(*TINY_MLP, *STEP, "precision=bf16"), tmp_path)
    assert s["achieved_tflops"] == pytest.approx(s["flops_per_step"] / s["step_time_s"] / 1e12)
    assert s["peak_tflops"] > 0 and s["mfu"] == pytest.approx(
        s["achieved_tflops"] / s["peak_tflops"]
    )


def test_gpu_peaks_come_from_the_datasheet_table(tmp_path):
    h200 = DeviceCaps("cuda", "NVIDIA H200", (9, 0))
    assert peak_tflops(h200, "bf16", tmp_path) == 989
    assert peak_tflops(h200, "tf32", tmp_path) == 494
    assert peak_tflops(DeviceCaps("cuda", "Tesla T4", (7, 5)), "bf16", tmp_path) is None
    assert peak_tflops(DeviceCaps("cuda", "Mystery GPU", (9, 0)), "fp16", tmp_path) is None


def test_speed_figures_leave_out_the_warm_up_and_flag_an_input_bound_run(tmp_path, capsys):
    cfg = make_cfg(
        *TINY_MLP,
        "trainer.max_steps=12",
        "trainer.log_every_n_steps=10",
        "trainer.benchmark.warmup_steps=3",
        "dataset._target_=tests.probes.SlowBlobs",
    )
    summary = run(cfg, tmp_path)
    rows = read_metrics(tmp_path)
    assert len({r["step_time_s"] for r in rows[:3]}) == 1  # the warm-up is an interval of its own
    assert rows[3]["step_time_s"] != rows[2]["step_time_s"]
    assert summary["step_time_p90_s"] >= summary["step_time_s"] >= 0.02
    assert 0.5 < summary["data_wait_share"] <= 1
    assert "input-bound" in capsys.readouterr().err
