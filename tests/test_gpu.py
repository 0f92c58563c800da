"""On a CUDA device (skipped elsewhere; scripts/gpu_check.sh runs them): every mode trains, the
optimizer step never waits for the GPU, and the GPU figures (memory, MFU) are filled in."""

from __future__ import annotations

import pytest
import torch

from runner.config import PrecisionConfig
from runner.precision import Precision
from runner.run import run
from tests.helpers import TINY_BERT, make_cfg

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16", "fp16_master"])
def test_a_fused_step_never_synchronises_with_the_gpu(mode):
    device = torch.device("cuda")
    precision = Precision(PrecisionConfig(mode=mode), device)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)).to(device)
    precision.prepare(model)
    groups = precision.optimizer_groups({"model": list(model.parameters())})
    optimizer = torch.optim.AdamW(groups["model"], lr=1e-3, fused=True)
    x = torch.randn(8, 64, device=device)
    for _ in range(3):
        with precision.autocast():
            loss = model(x).float().pow(2).mean()
        precision.backward([loss])
        torch.cuda.set_sync_debug_mode("error")  # any host-device sync raises
        try:
            result = precision.step([optimizer], list(model.parameters()), 1.0, loss=loss)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        optimizer.zero_grad(set_to_none=True)
    assert result.skipped.item() == 0.0
    precision.close()


@pytest.mark.parametrize(
    "mode", ["fp32", "tf32", "fp16", "bf16", "fp16_master", "staged", "fp8", "mxfp8", "bf16_true"]
)
def test_every_mode_trains_on_the_gpu_with_its_figures(tmp_path, mode):
    cfg = make_cfg(
        *TINY_BERT,
        f"precision={mode}",
        "trainer.device=cuda",
        "trainer.max_steps=30",
        "trainer.benchmark.warmup_steps=5",
        *(["precision.stages.0.until_step=10"] if mode == "staged" else []),
        *(["precision.allow_emulated=true"] if mode == "mxfp8" else []),  # its units: sm_100+
    )
    summary = run(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["skipped_steps"] == 0
    assert summary["device"].startswith("cuda") and summary["peak_memory_mb"] > 0
    assert summary["peak_reserved_mb"] >= summary["peak_memory_mb"]
    assert summary["mfu"] is None or 0 < summary["mfu"] < 1
    if mode in ("fp16", "bf16", "fp16_master", "staged", "fp8", "mxfp8", "bf16_true"):
        assert summary["low_precision_flop_share"] > 0.5
