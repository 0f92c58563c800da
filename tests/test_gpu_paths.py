"""The CUDA paths no CPU test reaches and tests/test_gpu.py does not check (docs/testing.md lists
which test covers which): each reads what happened from outside the runner's report where it
can. On a CUDA device only (skipped elsewhere; scripts/gpu_check.sh runs them)."""

from __future__ import annotations

import json

import pytest
import torch

from runner.errors import UserError
from runner.measure.peaks import device_model
from runner.run import run
from runner.train.telemetry import read_later
from tests.helpers import TINY_BERT, load_last, make_cfg, read_metrics
from tests.test_forensics import POISONED_STEP, _poisoned

pytestmark = pytest.mark.gpu
CUDA = [*TINY_BERT, "trainer.device=cuda", "trainer.val_check_interval=0"]


def test_a_loss_is_read_from_the_gpu_without_waiting_for_the_work_queued_after_it():
    """telemetry.read_later: a pinned copy and a CUDA event, so the host waits for the copy only."""
    x = torch.randn(8192, 8192, device="cuda")
    loss = (x @ x).mean()
    read = read_later(loss)
    for _ in range(30):  # about half a second of fp32 matmuls queued behind the copy
        later = x @ x
    value = read()
    assert not torch.cuda.current_stream().query(), "the read waited for the later work"
    torch.cuda.synchronize()
    assert value == pytest.approx(loss.item()) and later.shape == x.shape


def test_the_step_time_on_cuda_is_the_gpus_work_not_the_launches(tmp_path):
    """Telemetry times a log interval up to the read of its device values, which waits for the
    GPU. A step of about 5 TFLOP in fp32 takes the GPU far longer than the host takes to launch
    it: timed at the launches, MFU would come out above 1 (runner's `above_peak`)."""
    big = ["model.hidden_size=1024", "model.num_hidden_layers=4", "model.num_attention_heads=16"]
    big += ["model.intermediate_size=4096", "dataset.seq_len=512", "dataset.batch_size=32"]
    steps = ["trainer.max_steps=12", "trainer.benchmark.warmup_steps=4"]
    summary = run(make_cfg(*CUDA, *big, *steps, "precision=fp32"), tmp_path)
    assert summary["flops_per_step"] > 3e12 and "above_peak" not in summary
    if device_model(torch.cuda.get_device_name()):
        assert 0 < summary["mfu"] < 1


@pytest.mark.parametrize(("mode", "arithmetic"), [("tf32", "tf32"), ("fp32", "fp32")])
def test_fp32_matmuls_run_in_tf32_only_under_tf32_and_mfu_uses_the_datasheet(
    tmp_path, mode, arithmetic
):
    """The manifest reads CUDA's TF32 switch at each matmul (measure/matmuls.py); the run puts the
    switch back afterwards. MFU is against this GPU's datasheet peak where the table lists it."""
    before = torch.backends.cuda.matmul.allow_tf32
    summary = run(make_cfg(*CUDA, f"precision={mode}", "trainer.max_steps=3"), tmp_path)
    stage = summary["precision_manifest"]["stages"][0]
    assert {r["format"] for r in stage["by_class"] if r["class"] == "Linear"} == {arithmetic}
    assert torch.backends.cuda.matmul.allow_tf32 == before
    if device_model(torch.cuda.get_device_name()):
        assert summary["peak_tflops"] > 0 and summary["mfu"] is not None


def test_compile_on_cuda_compiles_the_step(tmp_path):
    """trainer.compile=true through Inductor's GPU backend (CPU tests compile for the CPU only)."""
    cfg = make_cfg(*CUDA, "precision=bf16", "trainer.compile=true", "trainer.max_steps=4")
    summary = run(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["skipped_steps"] == 0
    assert summary["compiled_graphs"] >= 1


def test_fused_and_foreach_adamw_skip_the_same_fp16_steps_and_end_alike(tmp_path):
    """GradScaler("cuda") with the fused AdamW (the step skipped on the device, no host read)
    against the unfused one (scaler.step): a scale of 2^20 overflows the first steps (3 of 8 on
    a CPU's fp16) and both skip the same ones, then update the weights alike."""
    common = [*CUDA, "precision=fp16", "precision.grad_scaler.init_scale=1048576"]
    common += ["trainer.max_steps=8", "trainer.benchmark.warmup_steps=1"]
    ends = {}
    for fused in ("true", "false"):
        summary = run(make_cfg(*common, f"optim.optimizer.fused={fused}"), tmp_path / fused)
        ends[fused] = (summary["skipped_steps"], load_last(tmp_path / fused)["model"])
    assert 0 < ends["true"][0] == ends["false"][0] < 8
    for name, weight in ends["true"][1].items():
        torch.testing.assert_close(weight, ends["false"][1][name], rtol=1e-4, atol=1e-6)


def test_a_resumed_run_continues_with_the_cuda_random_state_it_saved(tmp_path):
    """Dropout draws from the CUDA generator: its state is in the checkpoint (train/rng.py), so a
    run resumed at step 3 has the losses of one that did not stop (to CUDA's summation order)."""
    common = [*CUDA, "precision=bf16", "model.dropout=0.1"]
    run(make_cfg(*common, "trainer.max_steps=6"), tmp_path / "straight")
    run(make_cfg(*common, "trainer.max_steps=3"), tmp_path / "resumed")
    assert load_last(tmp_path / "resumed")["rng"]["cuda"]
    run(make_cfg(*common, "trainer.max_steps=6", "trainer.resume=auto"), tmp_path / "resumed")
    straight = [r["loss"] for r in read_metrics(tmp_path / "straight")]
    resumed = [r["loss"] for r in read_metrics(tmp_path / "resumed")]
    assert resumed == pytest.approx(straight, rel=1e-4)


def test_fp8_runs_torch_fp8_gemm_on_the_gpu_where_it_has_fp8_units(tmp_path, monkeypatch):
    """precision=fp8 on sm_89+: torchao's GEMMs reach torch._scaled_mm with fp8 operands on the
    GPU (seen by wrapping it), and the summary says native; below sm_89 it is refused."""
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(UserError, match="precision=fp8 is not supported natively here"):
            run(make_cfg(*CUDA, "precision=fp8", "trainer.max_steps=2"), tmp_path)
        return
    seen, scaled_mm = [], torch._scaled_mm

    def watched(a, b, *args, **kwargs):
        seen.append((a.dtype, b.dtype, a.device.type))
        return scaled_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", watched)
    summary = run(make_cfg(*CUDA, "precision=fp8", "trainer.max_steps=3"), tmp_path)
    assert summary["converted"]["kernels"] == "native" and summary["skipped_steps"] == 0
    assert seen and all(device == "cuda" for *_, device in seen)
    assert {torch.float8_e4m3fn, torch.float8_e5m2} >= {
        dtype for a, b, _ in seen for dtype in (a, b)
    }


def test_a_mode_this_gpu_has_no_units_for_is_refused_in_one_line(tmp_path):
    """plan.py: on a GPU without MXFP8 units (before sm_100) precision=mxfp8 is refused unless
    precision.allow_emulated=true (the CPU only warns: its autocast is software anyway)."""
    if torch.cuda.get_device_capability() >= (10, 0):
        pytest.skip("this GPU has MXFP8 units")
    with pytest.raises(UserError) as error:
        run(make_cfg(*CUDA, "precision=mxfp8", "trainer.max_steps=2"), tmp_path)
    assert str(error.value).startswith("precision=mxfp8 is not supported natively here")
    assert "\n" not in str(error.value)


def test_fp16_health_and_the_fp32_evaluation_run_their_references_on_cuda(tmp_path):
    """fp16 health's fp32 micro-batch (its CUDA RNG forked, measure/health.py) and the fp32
    evaluation of runner.eval_precisions (answers/inference.py: cuDNN's TF32 off for it)."""
    cfg = make_cfg(*CUDA, "precision=fp16", "trainer.max_steps=3", "runner.eval_precisions=[fp32]")
    summary = run(cfg, tmp_path)
    health = summary["fp16_health"]
    assert 0 <= health["underflow_share_unscaled"] <= 1 and health["audited_scale"] > 0
    fp32 = summary["eval_precisions"]["fp32"]
    assert fp32["status"] == "ok" and fp32["metrics"]["eval_loss"] > 0


def test_a_non_finite_step_on_cuda_is_skipped_replayed_and_named(tmp_path):
    """On CUDA the trainer learns of a skip a step late (the flag is read without a sync), then
    replays the failed step on its own weights with the CUDA RNG forked (train/diagnostics.py)."""
    overrides = [*_poisoned(batch=8, global_batch=8), "trainer.device=cuda", "trainer.max_steps=5"]
    summary = run(make_cfg(*overrides), tmp_path)
    assert summary["skipped_steps"] == 1
    report = json.loads((tmp_path / "nonfinite.json").read_text())
    assert report["step"] == POISONED_STEP and report["forward"]["first_nonfinite"] == "net.0"
