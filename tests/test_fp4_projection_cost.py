"""The projection charges FP4 GEMMs their quantization (issue 39): `amp_runner::fp4_mm`'s operands
are packed E2M1 data (two values a byte), so its precision-manifest records carry M/K/N unpacked,
and the projection prices each converted Linear's casts with the one model fp8 and mxfp8 use
(runner/measure/projection.py's `quantization_time`), nvfp4's apart from mxfp4's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.measure import gpus
from runner.measure import projection as P
from runner.precision.fp4 import Fp4Linear, Recipe
from runner.precision.fp4_quant import FORMATS
from tests.test_projection import _audit

pytest.importorskip("torchao")


def _fp4_step(m: int, k: int, n: int, fmt: str) -> dict:
    """The audited forward and backward of one bias-free FP4 Linear (k in, n out) on m tokens,
    with its format's default recipe (nvfp4: 2-D weight tiles, RHT, SR; mxfp4: none)."""
    torch.manual_seed(0)
    on = fmt == "nvfp4"
    layer = Fp4Linear(k, n, bias=False)
    layer.recipe = Recipe(FORMATS[fmt], weight_2d=on, rht=on, sr=on, seed=0)
    model = nn.Sequential(layer)
    x = torch.randn(m, k, requires_grad=True)
    return _audit(model, lambda: model(x).sum().backward(), fmt)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_gemm_records_carry_unpacked_mkn_and_pay_their_quantization(fmt):
    m, k, n = 64, 96, 32
    stage = _fp4_step(m, k, n, fmt)
    records = [r for r in stage["traffic"]["matmuls"] if r["op"] == "fp4_mm"]
    mkn = {r["direction"]: r["mkn"] for r in records}
    # forward x (m × k) @ Wᵀ; input gradient dy (m × n) @ W; weight gradient dyᵀ (n × m) @ x
    assert mkn == {"forward": [m, k, n], "input_grad": [m, n, k], "weight_grad": [n, m, k]}
    assert all(r["flops"] == 2 * m * k * n for r in records)
    b200 = gpus.spec("B200")
    projected = P.project_stage(stage, b200)
    assert projected["converted_linears"] == 1
    expected = P.quantization_time([m, k, n], records, fmt, b200)
    assert projected["quantization_s"] == pytest.approx(expected) and expected > 0


@pytest.mark.slow  # over 30 s on 2 cores: make test stays under 10 minutes
def test_a_gpt_projects_nvfp4_below_bf16_and_apart_from_mxfp4():
    """The issue's GPT (2 blocks, n_embd 128, 2048 tokens a step) on a B200, audited as
    `python -m runner.project` audits it: each FP4 GEMM record carries its Linear's M/K/N, and
    nvfp4's casts (16-value blocks, a tensor-wide amax) cost more than mxfp4's. Before the records
    had M/K/N, both projected 1.05× bf16, alike: their casts were free."""
    from runner.answers.projection import audit_precision
    from runner.project import _compose

    runs = {
        name: audit_precision(_compose(["model=gpt", f"precision={name}", "logger=none"]))
        for name in ("bf16", "nvfp4", "mxfp4")
    }
    block = "model.transformer.h.0."
    tokens = 16 * 128
    for name in ("nvfp4", "mxfp4"):
        forward = {
            r["module"].removeprefix(block): r["mkn"]
            for r in runs[name]["stage"]["traffic"]["matmuls"]
            if r["op"] == "fp4_mm" and r["direction"] == "forward"
        }
        # block 0's Linears but its first (c_attn); block 1 and the head stay bf16
        assert forward == {
            "attn.c_proj": [tokens, 128, 128],
            "mlp.c_fc": [tokens, 128, 512],
            "mlp.c_proj": [tokens, 512, 128],
        }
    projected = P.project(runs, ["B200"])["B200"]
    nvfp4, mxfp4 = projected["nvfp4"], projected["mxfp4"]
    assert nvfp4["converted_linears"] == mxfp4["converted_linears"] == 3
    assert nvfp4["quantization_s"] > mxfp4["quantization_s"] > 0
    assert nvfp4["step_time_s"] > mxfp4["step_time_s"]
    assert 0.95 < nvfp4["speedup_vs_bf16"] < 1.0  # 0.975× here
