"""Modes beyond one fixed autocast: `staged` (a schedule of modes by optimizer step) and
`fp16_master` (fp16 weights, fp32 master copy, dynamic loss scaling)."""

from __future__ import annotations

import json
from contextlib import ExitStack

import pytest
import torch
from omegaconf import OmegaConf

from runner.config import GradScalerConfig, PrecisionConfig, StageConfig
from runner.errors import UserError
from runner.measure import peaks
from runner.measure.flops import cpu_matmul_tflops, utilisation
from runner.precision import DeviceCaps, Precision
from runner.precision.modes import MODES, Mode, register
from runner.precision.modes.fp8 import Fp8
from runner.run import run
from runner.train.session import prepared, trainer_timer, workspace
from tests.helpers import TINY_BERT, TINY_MLP, cli, load_last, make_cfg, read_metrics

LOG_EACH = ["trainer.log_every_n_steps=1"]


def _staged(*stages: tuple[str, int | None]) -> Precision:
    cfg = OmegaConf.structured(
        PrecisionConfig(mode="staged", stages=[StageConfig(m, u) for m, u in stages])
    )
    return Precision(cfg, torch.device("cpu"))


def test_the_stage_switch_happens_exactly_at_the_configured_step(tmp_path):
    cfg = make_cfg(
        *TINY_MLP,
        *LOG_EACH,
        "precision=staged",
        "precision.stages.0.until_step=5",
        "trainer.max_steps=8",
    )
    summary = run(cfg, tmp_path)
    assert [r["precision"] for r in read_metrics(tmp_path)] == ["fp32"] * 5 + ["bf16"] * 3
    assert summary["precision"] == "staged" and summary["low_precision_flop_share"] > 0.9


def test_switching_carries_the_grad_scaler_across_other_stages():
    p = _staged(("fp32", 2), ("fp16", 4), ("fp16", 6), ("bf16", 8), ("fp16", None))
    assert p.mode == "fp32" and p.scaler is None
    assert p.at_step(2) and p.mode == "fp16" and p.scaler is not None  # created
    first = p.scaler
    first.scale(torch.ones(()))  # the scale is made on first use
    first.grad_scaler.update(new_scale=8.0)
    assert not p.at_step(4) and p.scaler is first and p.loss_scale == 8.0  # carried
    assert p.at_step(6) and p.mode == "bf16" and p.scaler is None  # dormant
    assert p.state_dict()["scaler"]["scale"] == 8.0  # checkpointed while dormant
    assert p.at_step(8) and p.mode == "fp16" and p.scaler is first and p.loss_scale == 8.0
    p.close()


def test_a_staged_run_resumes_in_its_stage_with_its_scaler(tmp_path):
    staged = [
        *TINY_BERT,
        *LOG_EACH,
        "precision=staged",
        "precision.stages=[{mode:fp16,until_step:5},{mode:bf16}]",
        "precision.grad_scaler.growth_interval=1",  # the scale moves every step
    ]
    run(make_cfg(*staged, "trainer.max_steps=8"), tmp_path / "straight")
    run(make_cfg(*staged, "trainer.max_steps=3"), tmp_path / "resumed")
    assert load_last(tmp_path / "resumed")["scaler"]["scale"] == 65536.0 * 2**3
    run(make_cfg(*staged, "trainer.max_steps=8", "trainer.resume=auto"), tmp_path / "resumed")
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["precision"] for r in b] == ["fp16"] * 5 + ["bf16"] * 3
    assert [(r["loss"], r["loss_scale"]) for r in a] == [(r["loss"], r["loss_scale"]) for r in b]
    straight, resumed = load_last(tmp_path / "straight"), load_last(tmp_path / "resumed")
    for name, tensor in straight["model"].items():
        assert torch.equal(resumed["model"][name], tensor), name
    assert resumed["scaler"] == straight["scaler"]  # dormant in the bf16 stage, still saved


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ("[{mode:fp32,until_step:5},{mode:bf16,until_step:9}]", "the last stage runs to the end"),
        ("[{mode:fp32,until_step:5},{mode:fp16,until_step:5},{mode:bf16}]", "after the previous"),
        (
            "[{mode:fp16_master,until_step:5},{mode:bf16}]",
            "allowed: fp32, tf32, fp16, bf16, fp8, mxfp8, nvfp4, mxfp4, auto",
        ),
        ("[{mode:fp32},{mode:bf16}]", "precision.stages.0.until_step=None is invalid"),
    ],
)
def test_bad_stages_get_one_clear_line(tmp_path, stages, message):
    result = cli(*TINY_MLP, "precision=staged", f"precision.stages={stages}", cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_fp16_master_keeps_fp16_weights_an_fp32_master_copy_and_accounts_for_it(tmp_path):
    summary = run(
        make_cfg(*TINY_BERT, "precision=fp16_master", "trainer.max_steps=3"), tmp_path / "master"
    )
    fp32 = run(make_cfg(*TINY_BERT, "precision=fp32", "trainer.max_steps=3"), tmp_path / "fp32")
    state = load_last(tmp_path / "master")
    model, masters = state["model"], state["master_weights"]
    norms = {k for k in model if "LayerNorm" in k}
    assert norms and all(model[k].dtype == torch.float32 for k in norms)
    halves = [k for k in model if k not in norms and model[k].is_floating_point()]
    assert all(model[k].dtype == torch.float16 for k in halves)
    assert masters and all(m.dtype == torch.float32 for m in masters)
    # each fp16 weight is its master rounded to fp16, and the masters have moved with training
    by_shape = {tuple(m.shape): m for m in masters}
    weight = model["model.bert.encoder.layer.0.intermediate.dense.weight"]
    master = by_shape[tuple(weight.shape)]
    assert torch.equal(master.half(), weight)
    assert summary["master_weights_mb"] > 0
    assert summary["weights_mb"] + summary["master_weights_mb"] / 2 == pytest.approx(
        fp32["weights_mb"], rel=0.05
    )  # fp16 copies take half of what their fp32 masters take
    assert summary["precision"] == "fp16_master" and summary["final_loss_scale"] > 0


@pytest.mark.slow  # over 10 s on 2 cores: make test stays under 10 minutes
def test_fp16_master_trains_bert_to_a_loss_close_to_fp32(tmp_path):
    common = [
        *TINY_BERT,
        "model.hidden_size=64",
        "model.intermediate_size=128",
        "optim.optimizer.lr=2e-3",
        "trainer.max_steps=80",
        "trainer.val_check_interval=80",
    ]
    fp32 = run(make_cfg(*common, "precision=fp32"), tmp_path / "fp32")
    master = run(make_cfg(*common, "precision=fp16_master"), tmp_path / "master")
    start = read_metrics(tmp_path / "fp32")[0]["loss"]
    assert fp32["eval_loss"] < 0.9 * start  # it learned something to compare
    assert master["eval_loss"] == pytest.approx(fp32["eval_loss"], rel=0.03)
    assert master["skipped_steps"] == 0


@pytest.mark.slow  # over 10 s on 2 cores: make test stays under 10 minutes
def test_every_mode_appears_in_one_comparison_like_any_other(tmp_path):
    """staged, fp16_master, and the frontier's fp8, mxfp8, nvfp4, mxfp4 and bf16_true in one sweep
    with fp32 and bf16. The rows that converted Linears say which share of the step's FLOPs ran in
    their format (the dispatcher's count of fp8 and fp4 GEMMs), the others leave it empty."""
    sweep = tmp_path / "sweep"
    converting = ["fp8", "mxfp8", "nvfp4", "mxfp4"]
    modes = ["fp32", "bf16", "staged", "fp16_master", *converting, "bf16_true"]
    result = cli(
        "-m",
        f"precision={','.join(modes)}",
        *TINY_MLP,
        "trainer.max_steps=12",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    jobs = json.loads((sweep / "compare.json").read_text())
    assert sorted(j["precision"] for j in jobs) == sorted(modes)
    assert all(j["status"] == "completed" for j in jobs)
    share = {j["precision"]: j["converted_flop_share"] for j in jobs}
    assert all(0 < share[m] < 1 for m in converting), share  # the head and the rest: not fp8/fp4
    assert all(share[m] is None for m in modes if m not in converting), share
    md = (sweep / "compare.md").read_text()
    assert "fp16_master" in md and "| fp8/fp4 FLOPs |" in md and "| gap to bf16 [95% CI] |" in md
    # beside the gap to fp32, each low-precision row's gap to bf16, from the jobs' own eval losses
    evals = {
        s["precision"]: s["eval_loss"]
        for s in (json.loads(p.read_text()) for p in sweep.glob("*/summary.json"))
    }
    gap = {j["precision"]: j["loss_gap_bf16"] for j in jobs}
    for mode in converting:
        assert gap[mode] == pytest.approx((evals[mode] - evals["bf16"]) / evals["bf16"])
    assert gap["fp32"] is None and gap["bf16"] is None
    # no CPU has fp8 or fp4 units: those rows' speed is the emulation's, and their verdicts say so
    verdicts = {j["precision"]: j["verdict"] for j in jobs}
    for mode in converting:
        assert "speed emulated: its " + mode + " matmuls were emulated" in verdicts[mode]


def test_resuming_fp16_master_needs_the_master_weights():
    p = Precision(OmegaConf.structured(PrecisionConfig(mode="fp16_master")), torch.device("cpu"))
    p.prepare(torch.nn.Linear(2, 2))
    with pytest.raises(UserError, match="no fp32 master weights"):
        p.load_state_dict({"scaler": None})  # e.g. a checkpoint of an fp16 run


def test_fp16_master_leaves_fp32_islands_in_fp32(tmp_path):
    cfg = make_cfg(
        *TINY_BERT,
        "precision=fp16_master",
        "precision.fp32_modules=[model.cls]",
        "trainer.max_steps=3",
    )
    assert run(cfg, tmp_path)["status"] == "completed"
    model = load_last(tmp_path)["model"]
    assert model["model.cls.predictions.transform.dense.weight"].dtype == torch.float32
    assert model["model.bert.encoder.layer.0.output.dense.weight"].dtype == torch.float16


def _fp16_master() -> Precision:
    cfg = PrecisionConfig(mode="fp16_master", grad_scaler=GradScalerConfig(init_scale=1.0))
    return Precision(OmegaConf.structured(cfg), torch.device("cpu"))


def test_fp16_master_accumulates_micro_batches_in_fp32():
    """1 + 1e-4 is 1 in fp16 (its spacing at 1 is 1e-3): summed in fp16 the second micro-batch's
    gradient would vanish; the fp32 master gradient keeps it."""
    p = _fp16_master()
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    p.prepare(model)
    for contribution in (1.0, 1e-4):  # d(loss)/d(weight) = contribution for an input of 1
        with p.autocast():
            loss = model(torch.full((1, 1), contribution)).float().sum()
        p.backward([loss])
        assert model.weight.grad is None  # moved into the fp32 master gradient
    (master,) = p.master.masters.values()
    assert master.grad.dtype == torch.float32
    assert master.grad.item() == pytest.approx(1.0001, rel=1e-5)
    p.close()


def test_fp16_master_keeps_rmsnorm_fp32_and_gives_frozen_weights_no_master():
    p = _fp16_master()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.RMSNorm(4), torch.nn.Linear(4, 2))
    model[2].weight.requires_grad_(False)
    p.prepare(model)
    assert model[1].weight.dtype == torch.float32  # the norm stays fp32
    assert model[0].weight.dtype == model[2].weight.dtype == torch.float16
    masters = p.master.masters
    assert model[0].weight in masters and model[2].weight not in masters  # frozen: no copy
    assert model[2].bias in masters
    p.close()


class Fp4Toy(Fp8):
    """A mode from elsewhere that no runner code names: converted Linears (fp8's) computing in a
    new arithmetic (fp4) and bf16 autocast."""


@pytest.fixture
def new_modes():
    modes = [
        register(Mode("tf32_too", compute="tf32", tf32=True)),
        register(
            Fp4Toy(
                "fp4_toy", compute="fp4", autocast=torch.bfloat16, converts=True, mfu_also_vs="bf16"
            )
        ),
    ]
    yield {m.name: m for m in modes}
    for m in modes:
        del MODES[m.name]


def test_a_registered_mode_is_honoured_by_its_attributes_not_its_name(
    new_modes, tmp_path, monkeypatch
):
    """Its TF32 setting where the interleaved timing runs it (runner/train/session.py), its MFU
    peak (its `compute`'s, also against `mfu_also_vs`'s) and, as a converting mode, no CPU matmul rate."""
    cfg = make_cfg(*TINY_MLP, "precision.mode=tf32_too", "trainer.max_steps=2")
    with ExitStack() as stack:
        device, data, task, log = workspace(cfg, stack)
        variant, precision = prepared(cfg, task, device, stack)
        fit = trainer_timer(cfg, variant, data, precision, log, 0, 1)
        torch.set_float32_matmul_precision("highest")
        fit()
        assert torch.get_float32_matmul_precision() == "high"
        assert precision.peak_mode is new_modes["tf32_too"]
    fp4 = new_modes["fp4_toy"]
    cpu = DeviceCaps("cpu", "a CPU")
    assert cpu_matmul_tflops(cpu, fp4, tmp_path) is None  # none measured: torchao-style emulation
    u = utilisation({"flops_per_step": 1e9, "step_time_s": 0.1}, cpu, fp4, tmp_path)
    assert u["mfu"] is None and "no fp4 matmul ceiling" in u["peak_note"]
    monkeypatch.setitem(
        peaks.GPU_PEAK_TFLOPS, "B200", peaks.GPU_PEAK_TFLOPS["B200"] | {"fp4": 9000}
    )
    b200 = DeviceCaps("cuda", "NVIDIA B200", (10, 0))
    u = utilisation({"flops_per_step": 2250e12, "step_time_s": 1.0}, b200, fp4, tmp_path)
    assert u["peak_mode"] == "fp4" and u["mfu"] == pytest.approx(0.25)
    assert u["mfu_vs_bf16_peak"] == pytest.approx(1.0) and u["mfu_vs_mode_peak"] == u["mfu"]
