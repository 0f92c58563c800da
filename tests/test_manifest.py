"""The precision manifest (runner/measure/manifest.py): each matmul of the audited step by module,
direction, operand formats and the format it computed in, recorded at the dispatcher, and held
against the plan (`plan_held`, `precision_manifest.mismatches`). Each plan test also breaks what
it checks (an island's autocast, fp8's conversion, the fast CPU kernels' cast, a frozen weight)
and watches the plan fail, with a fact read from outside the manifest beside it."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from runner.answers import inference
from runner.precision import Precision, cpu_kernels, fp32_islands
from runner.precision.converted import ConvertedLinears
from runner.run import run
from tests.helpers import load_last, make_cfg, module_run, read_metrics
from tests.test_hf import causal_lm_on_text, hf, tiny_gpt2_and_text

NET = "tests.test_own_model.Net"
LINEARS = {"net.blocks.0.0", "net.blocks.1.0", "net.head"}
FIRST = "net.blocks.0.0"  # its input is the data: no gradient of the input


def ops(summary: dict, stage: int = 0, prefix: str = "") -> list[dict]:
    modules = summary["precision_manifest"]["stages"][stage]["modules"]
    return [
        o | {"module": name, "class": entry["class"]}
        for name, entry in modules.items()
        if name.startswith(prefix)
        for o in entry["ops"]
    ]


def gpt2(tmp_path, *overrides: str, layers: int = 1):
    folder, text = tiny_gpt2_and_text(tmp_path, documents=40, layers=layers)
    return lambda *more: hf(
        folder,
        *causal_lm_on_text(text),
        "dataset.seq_len=32",
        "dataset.batch_size=4",
        "trainer.max_steps=2",
        "trainer.val_check_interval=0",
        *overrides,
        *more,
    )


def test_a_bf16_step_records_every_linear_in_every_direction(tmp_path, capsys):
    """model=module: a user's net of three Linears, each with its forward, the gradient of its
    weight and (past the first) of its input, all in bf16; their FLOPs are the step's; the table
    is printed at the start, and the manifest reaches summary.json."""
    cfg = make_cfg(*module_run(NET, "precision=bf16", "precision.cpu_kernels=native"))
    summary = run(cfg, tmp_path)
    seen = ops(summary)
    assert {o["module"] for o in seen} == LINEARS
    for name in LINEARS:
        directions = {o["direction"] for o in seen if o["module"] == name}
        grads = {"weight_grad"} | (set() if name == FIRST else {"input_grad"})
        assert directions == {"forward"} | grads, name
    assert {(o["format"], tuple(o["inputs"])) for o in seen} == {("bf16", ("bf16",))}
    assert sum(o["flops"] for o in seen) == summary["flops_per_step"]
    assert summary["plan_held"] is True
    printed = capsys.readouterr()
    assert "precision manifest: bf16, the matmuls of step 1" in printed.out + printed.err
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["precision_manifest"]["stages"][0]["modules"].keys() == LINEARS


@pytest.mark.parametrize("kernels, computed", [("fast", "fp32"), ("native", "bf16")])
def test_the_fast_cpu_kernels_compute_bf16_matmuls_in_fp32(tmp_path, kernels, computed):
    """precision.cpu_kernels=fast hands PyTorch's fp32 kernels the bf16 operands in fp32; native
    runs the bf16 kernels. On a CPU with bf16 units the two losses agree, so only the format
    each matmul computed in tells them apart."""
    cfg = make_cfg(*module_run(NET, "precision=bf16", f"precision.cpu_kernels={kernels}"))
    summary = run(cfg, tmp_path)
    assert {(o["format"], tuple(o["inputs"])) for o in ops(summary)} == {(computed, ("bf16",))}
    assert summary["plan_held"] is True


def test_fast_kernels_that_compute_in_bf16_break_the_plan(tmp_path, monkeypatch):
    """The break the suite once missed: `fast` handing PyTorch's kernel the low-precision
    operands instead of fp32 ones (on a CPU with bf16 units the numbers barely move)."""

    def in_low_precision(self, op, keyset, dtype, args, kwargs):
        self.calls += 1
        cpu_kernels.COMPUTED.dtype = dtype  # what this kernel hands PyTorch's: the bf16 operands
        return op.redispatch(keyset.remove(cpu_kernels._BACKEND_SELECT), *args, **kwargs)

    monkeypatch.setattr(cpu_kernels.FastKernels, "_in_fp32", in_low_precision)
    cfg = make_cfg(*module_run(NET, "precision=bf16", "precision.cpu_kernels=fast"))
    summary = run(cfg, tmp_path)
    mismatches = summary["precision_manifest"]["mismatches"]
    assert summary["plan_held"] is False
    assert any("computes its matmuls in fp32" in m and "ran in bf16" in m for m in mismatches)


def test_an_island_computes_in_fp32_in_every_direction(tmp_path, monkeypatch):
    """transformers' GPT-2 with its MLP (two Conv1D) an fp32 island under gradient
    checkpointing: forward, both gradients and the recomputed forward in fp32 on fp32 inputs;
    the attention's Conv1D in bf16. With the island's autocast left on, the plan fails on it and
    the loss moves."""
    cfg = gpt2(
        tmp_path,
        "precision=bf16",
        "precision.cpu_kernels=native",
        "precision.fp32_modules=[net.transformer.h.0.mlp]",
        "model.gradient_checkpointing=true",
    )
    summary = run(cfg(), tmp_path / "island")
    mlp = ops(summary, prefix="net.transformer.h.0.mlp")
    assert {o["direction"] for o in mlp} == {"forward", "input_grad", "weight_grad", "recompute"}
    assert {(o["format"], tuple(o["inputs"])) for o in mlp} == {("fp32", ("fp32",))}
    attention = ops(summary, prefix="net.transformer.h.0.attn.c_attn")
    assert {o["format"] for o in attention} == {"bf16"}
    assert summary["plan_held"] is True

    monkeypatch.setattr(
        fp32_islands, "_island", lambda _device, _module, forward, *a, **k: forward(*a, **k)
    )
    broken = run(cfg(), tmp_path / "broken")
    assert broken["plan_held"] is False
    assert any(
        m.startswith("the plan keeps net.transformer.h.0.mlp in fp32; net.transformer.h.0.mlp.c_fc")
        for m in broken["precision_manifest"]["mismatches"]
    )
    island_loss = read_metrics(tmp_path / "island")[0]["loss"]
    assert read_metrics(tmp_path / "broken")[0]["loss"] != island_loss


def test_fp8_runs_what_it_converts_in_fp8_and_lists_the_rest(tmp_path, monkeypatch):
    """GPT-2 under fp8: every Linear the plan converts runs its forward and its input's gradient
    in fp8, every one it leaves out is in fp8.skipped with its reason and runs no fp8 matmul.
    A conversion whose switch runs the plain Linear breaks the plan, naming the layer."""
    cfg = gpt2(tmp_path, "precision=fp8")
    summary = run(cfg(), tmp_path / "fp8")
    skipped = summary["converted"]["skipped"]
    seen = ops(summary)
    linears = {o["module"] for o in seen if o["class"] in ("Conv1D", "Linear", "Float8Linear")}
    converted = linears - set(skipped)
    assert converted and set(skipped) & linears
    for o in seen:
        if o["module"] in converted and o["direction"] in ("forward", "input_grad"):
            assert o["format"] == "fp8" and o["inputs"][0].startswith("fp8 e"), o
        if o["module"] in skipped:
            assert o["format"] not in ("fp8", "mxfp8"), o
    assert summary["plan_held"] is True

    monkeypatch.setattr(
        ConvertedLinears, "_switch", lambda self, module, fwd, x: nn.Linear.forward(module, x)
    )
    broken = run(cfg(), tmp_path / "plain")
    assert broken["plan_held"] is False
    name = sorted(converted)[0]
    assert any(
        m.startswith(f"the plan converts {name} to fp8; {name}'s forward")
        for m in broken["precision_manifest"]["mismatches"]
    )


def test_a_frozen_weight_that_trains_breaks_the_plan(tmp_path, monkeypatch):
    """model.freeze: the frozen block's parameters are not trainable, unchanged over the run (and
    byte-identical in the checkpoint) and hold no optimizer state, while the rest changed. A
    preparation that unfreezes them breaks the plan on each."""
    cfg = make_cfg(*module_run(NET, "precision=bf16", "model.freeze=[blocks.0]"))
    initial = None

    def capture(self, model, *args):
        nonlocal initial
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        prepare(self, model, *args)

    prepare = Precision.prepare
    with monkeypatch.context() as patch:
        patch.setattr(Precision, "prepare", capture)
        summary = run(cfg, tmp_path / "frozen")
    params = summary["precision_manifest"]["parameters"]
    frozen = {n for n in params if n.startswith("net.blocks.0.")}
    assert frozen == {"net.blocks.0.0.weight", "net.blocks.0.0.bias"}
    for name, p in params.items():
        assert p["trainable"] is (name not in frozen)
        assert p["changed"] is (name not in frozen)
        assert bool(p["optimizer_state"]) is (name not in frozen)
    saved = load_last(tmp_path / "frozen")["model"]
    assert all(torch.equal(saved[n], initial[n]) for n in frozen)
    assert summary["plan_held"] is True

    def unfreezing(self, model, *args):
        prepare(self, model, *args)
        for p in model.parameters():
            p.requires_grad_(True)

    monkeypatch.setattr(Precision, "prepare", unfreezing)
    broken = run(cfg, tmp_path / "unfrozen")
    mismatches = broken["precision_manifest"]["mismatches"]
    for what in ("it was made trainable", "it changed over the run", "it holds optimizer state"):
        assert f"the plan freezes net.blocks.0.0.weight; {what}" in mismatches
    assert broken["plan_held"] is False


def test_each_stage_of_a_staged_run_is_held_against_its_mode(tmp_path):
    """precision=staged: the first step of each stage is audited, in that stage's mode."""
    cfg = make_cfg(
        *module_run(
            NET,
            "precision=staged",
            "precision.stages=[{mode:fp32,until_step:1},{mode:bf16}]",
            "precision.cpu_kernels=native",
        )
    )
    summary = run(cfg, tmp_path)
    stages = summary["precision_manifest"]["stages"]
    assert [(s["mode"], s["step"]) for s in stages] == [("fp32", 1), ("bf16", 2)]
    assert {o["format"] for o in ops(summary, 0)} == {"fp32"}
    assert {o["format"] for o in ops(summary, 1)} == {"bf16"}
    assert summary["plan_held"] is True


@pytest.mark.parametrize("mode", ["bf16_true", "fp8"])
def test_the_fp32_evaluation_computes_in_fp32_only(tmp_path, monkeypatch, mode):
    """runner.eval_precisions' fp32 row after bf16_true (norms cast) and fp8 (converted Linears):
    every matmul and every module's output in fp32. A reference copied from the trained model
    (its casts and fp8 layers with it) breaks the plan, and its eval loss moves."""
    cfg = gpt2(tmp_path, f"precision={mode}", "runner.eval_precisions=[fp32,bf16]")
    summary = run(cfg(), tmp_path / "weights")
    evaluation = summary["precision_manifest"]["evaluation"]["fp32"]["modules"]
    formats = {o["format"] for entry in evaluation.values() for o in entry["ops"]}
    assert formats == {"fp32"}
    assert summary["plan_held"] is True

    monkeypatch.setattr(inference, "trained_weights", lambda task, masters: task)
    copied = run(cfg(), tmp_path / "copied")
    assert copied["plan_held"] is False
    assert any(
        m.startswith("the fp32 evaluation (runner.eval_precisions) computes in fp32;")
        for m in copied["precision_manifest"]["mismatches"]
    )
    loss = summary["eval_precisions"]["fp32"]["metrics"]["eval_loss"]
    assert copied["eval_precisions"]["fp32"]["metrics"]["eval_loss"] != loss


def test_a_lora_adapter_and_its_fp8_base_are_told_apart(tmp_path, cpu_kind):
    """LoRA on GPT-2's c_attn under fp8: the adapter and its converted base take the same input,
    whose gradient both add to; each one's matmuls are its own (the base fp8, the adapters bf16
    autocast: computed in bf16, or in fp32 where the run's fast CPU kernels took them)."""
    cfg = gpt2(
        tmp_path,
        "precision=fp8",
        "precision.fp8.skip=[]",
        "model.peft={r:16,alpha:32,target_modules:[c_attn]}",
        layers=2,
    )
    summary = run(cfg(), tmp_path / "lora")
    # the second block's: its input's gradient is needed (the first block's adapters train)
    base = ops(summary, prefix="net.base_model.model.transformer.h.1.attn.c_attn.base_layer")
    adapters = ops(summary, prefix="net.base_model.model.transformer.h.1.attn.c_attn.lora_")
    assert {(o["direction"], o["format"]) for o in base if o["direction"] != "weight_grad"} == {
        ("forward", "fp8"),
        ("input_grad", "fp8"),
    }
    adapter_format = {"native": "bf16", "fast": "fp32"}[summary["cpu_kernels"]]
    assert adapters and {o["format"] for o in adapters} == {adapter_format}
    assert summary["plan_held"] is True


def test_the_fp32_evaluation_of_a_users_net_records_its_linears(tmp_path):
    """Under inference_mode an nn.Linear reaches the dispatcher whole (aten.linear, not
    decomposed into addmm): the fp32 row's record still holds each Linear, in fp32."""
    cfg = make_cfg(
        *module_run(NET, "precision=bf16", "runner.eval_precisions=[fp32,bf16]"),
        "dataset.validation._target_=tests.test_own_model.pairs",
    )
    summary = run(cfg, tmp_path)
    evaluation = summary["precision_manifest"]["evaluation"]["fp32"]["modules"]
    assert set(evaluation) == LINEARS
    assert {o["format"] for entry in evaluation.values() for o in entry["ops"]} == {"fp32"}


class UpProjection(nn.Module):
    """Llama's MLP in small between a first Linear and a last block: an up-projection (32 → 64,
    its weight 64 × 32) and a down-projection. At 64 rows a micro-batch the up-projection's input
    gradient (64 × 32) has its weight's shape, as Llama's up_proj at 64 tokens."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Sequential(nn.Linear(8, 32)),
            nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)),
            nn.Sequential(nn.Linear(32, 32)),
        )
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.blocks(x))


@pytest.mark.parametrize("mode", ["bf16", "fp8", "mxfp8", "nvfp4", "mxfp4"])
def test_an_input_gradient_of_the_weights_shape_is_not_the_weights_gradient(tmp_path, mode):
    """The up-projection's three matmuls, each its own direction in every mode: its input's
    gradient takes the weight (a cast, a transpose or a quantized form of it: mxfp8's MXTensor
    carries no role), whatever shape its output has."""
    cfg = make_cfg(
        *module_run(f"{__name__}.UpProjection", f"precision={mode}", "dataset.batch_size=64")
    )
    summary = run(cfg, tmp_path)
    calls: dict[str, int] = {}
    for o in ops(summary, prefix="net.blocks.1.0"):
        calls[o["direction"]] = calls.get(o["direction"], 0) + o["calls"]
    assert calls == {"forward": 1, "input_grad": 1, "weight_grad": 1}
    if mode != "bf16":  # the up-projection converts, and computes each direction in the format
        assert {o["format"] for o in ops(summary, prefix="net.blocks.1.0")} == {mode}
    assert summary["plan_held"] is True
