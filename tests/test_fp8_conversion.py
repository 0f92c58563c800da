"""What fp8 and mxfp8 do to the modules they replace (issue 29 §4), on transformers' own GPT-2,
whose projections are `Conv1D`s (an nn.Linear with its weight stored (in, out)): the replacement
keeps the trainability of what it replaced (a LoRA base and `model.freeze` stay frozen), an fp32
island on a Conv1D stays an fp32 Conv1D, LoRA's adapters stay out of fp8, and checkpoints hold the
model's own layout (Conv1D's), so they export, resume in another mode and load into the model as
built. Read off the modules' classes, `requires_grad`, the outputs' dtypes and the checkpoint."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers
from omegaconf import OmegaConf

from runner.export import export
from runner.precision import Precision
from runner.run import build, run
from runner.train.convert import convert_precision
from tests.helpers import load_last
from tests.test_hf import short_causal_lm, tiny_gpt2_and_text

pytest.importorskip("torchao")

CPU = torch.device("cpu")
CONVERTED = {"fp8": "Float8Linear", "mxfp8": "MXFP8Linear"}  # torchao's converted classes
# r=32: LoRA's A (32→32) and B (32→96) are multiples of 16 and of MXFP8's block of 32
LORA = "model.peft={r:32,alpha:32,target_modules:[c_attn]}"
ADAPTERS = 32 * (32 + 96)  # one block's c_attn: A is 32×32, B is 32×96
PEFT = "net.base_model.model.transformer.h.0"  # a block's name under PEFT's wrapper
BLOCK = "net.transformer.h.0"


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A one-block GPT-2 (n_embd=32: c_attn 32→96, c_fc 32→128), saved, and a small corpus."""
    return tiny_gpt2_and_text(tmp_path_factory.mktemp("gpt2"), documents=40)


def _cfg(gpt2, mode: str, *overrides: str):
    folder, text = gpt2
    return short_causal_lm(folder, text, f"precision={mode}", "precision.fp8.skip=[]", *overrides)


def _prepared(cfg):
    """The task as `cfg` builds it, prepared for its precision; the precision; the number of
    parameters that trained before."""
    _, task = build(cfg)
    before = _trainable(task)
    return task, _prepare(cfg, task), before


def _prepare(cfg, task) -> Precision:
    precision = Precision(cfg.precision, CPU)
    precision.prepare(task, cfg.precision.fp32_modules)
    return precision


def _trainable(task) -> int:
    return sum(p.numel() for p in task.parameters() if p.requires_grad)


def _output_dtypes(task, precision, names: list[str]) -> dict[str, torch.dtype]:
    """The dtype each named module's forward returns in one training forward under autocast."""
    seen = {}

    def record(name: str):
        return lambda _module, _args, out: seen.update({name: out.dtype})

    handles = [task.get_submodule(n).register_forward_hook(record(n)) for n in names]
    precision.converted.active = True
    with precision.autocast():
        task.net(input_ids=torch.randint(0, 20, (2, 16)))
    for handle in handles:
        handle.remove()
    return seen


@pytest.mark.parametrize("mode", CONVERTED)
def test_a_lora_base_stays_frozen_in_fp8_and_its_adapters_export(tmp_path, gpt2, mode):
    """The frozen Conv1D base becomes torchao's class, still frozen: the adapters alone train,
    the checkpoint leaves the base out, a resume puts this run's base back, and the export loads
    back onto the saved GPT-2."""
    task, _, before = _prepared(_cfg(gpt2, mode, LORA))
    base = task.get_submodule(f"{PEFT}.attn.c_attn.base_layer")
    assert type(base).__name__ == CONVERTED[mode]
    assert not base.weight.requires_grad and not base.bias.requires_grad
    assert _trainable(task) == before == ADAPTERS
    run(_cfg(gpt2, mode, LORA, "trainer.max_steps=1"), tmp_path / "run")
    summary = run(_cfg(gpt2, mode, LORA, "trainer.resume=auto"), tmp_path / "run")
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert summary["trainable_parameters"] == ADAPTERS
    saved = load_last(tmp_path / "run")["model"]
    assert not [k for k in saved if "base_layer" in k or ".c_fc." in k]  # the base left out
    out = export(tmp_path / "run")
    loaded = peft.PeftModel.from_pretrained(
        transformers.GPT2LMHeadModel.from_pretrained(gpt2[0]), out
    )
    adapter = loaded.base_model.model.transformer.h[0].attn.c_attn.lora_B["default"].weight
    assert torch.equal(adapter, saved[f"{PEFT}.attn.c_attn.lora_B.default.weight"])


@pytest.mark.parametrize("mode", CONVERTED)
def test_lora_adapters_stay_out_of_fp8_unless_asked(gpt2, mode):
    """r=32: A and B are Linears fp8's rules would convert; they stay plain, computing in
    autocast's bf16, skipped with their reason; precision.fp8.convert_adapters=true converts
    them."""
    adapters = [f"{PEFT}.attn.c_attn.lora_{ab}.default" for ab in "AB"]
    task, precision, _ = _prepared(_cfg(gpt2, mode, LORA))
    assert [type(task.get_submodule(n)) for n in adapters] == [torch.nn.Linear] * 2
    assert all("adapter" in precision.converted.skipped[n] for n in adapters)
    assert set(_output_dtypes(task, precision, adapters).values()) == {torch.bfloat16}
    task, _, _ = _prepared(_cfg(gpt2, mode, LORA, "precision.fp8.convert_adapters=true"))
    assert {type(task.get_submodule(n)).__name__ for n in adapters} == {CONVERTED[mode]}


@pytest.mark.parametrize("mode", CONVERTED)
def test_an_island_on_a_conv1d_stays_an_fp32_conv1d(gpt2, mode):
    """And the Conv1D next to it converts with the forward hook it had before."""
    island, neighbour = f"{BLOCK}.mlp.c_fc", f"{BLOCK}.mlp.c_proj"
    cfg = _cfg(gpt2, mode, f"precision.fp32_modules=[{island}]")
    _, task = build(cfg)
    hooked = []
    task.get_submodule(neighbour).register_forward_hook(lambda *args: hooked.append(args[-1].dtype))
    precision = _prepare(cfg, task)
    assert type(task.get_submodule(island)).__name__ == "Conv1D"
    assert type(task.get_submodule(neighbour)).__name__ == CONVERTED[mode]
    assert precision.converted.skipped[island] == "inside an fp32 island"
    assert island not in precision.converted.report()["converted"]
    assert _output_dtypes(task, precision, [island])[island] == torch.float32
    assert hooked == [torch.bfloat16]


@pytest.mark.parametrize("mode", CONVERTED)
def test_frozen_conv1ds_stay_frozen_and_checkpoints_hold_gpt2s_own_layout(tmp_path, gpt2, mode):
    """model.freeze on the attention: its Conv1Ds convert and stay frozen; the checkpoint holds
    every tensor in the shape GPT-2's Conv1D has, the frozen ones byte for byte as saved, and the
    converted model's state loads into the model as built and back (the island search's replay).
    The checkpoint resumes in fp8 exactly and in bf16, where the model is not converted."""
    freeze = "model.freeze=[transformer.h.0.attn]"
    task, _, before = _prepared(_cfg(gpt2, mode, freeze))
    frozen = task.get_submodule(f"{BLOCK}.attn.c_attn")
    assert type(frozen).__name__ == CONVERTED[mode] and not frozen.weight.requires_grad
    assert _trainable(task) == before
    _, plain = build(_cfg(gpt2, mode, freeze))
    own = plain.state_dict()
    plain.load_state_dict(task.state_dict())
    task.load_state_dict(own)

    steps = [
        "optim.optimizer.fused=false",
        "optim.scheduler.warmup_steps=0",
        "optim.scheduler.decay=constant",  # the schedule of a 2-step run is the 4-step one's
    ]
    whole = run(_cfg(gpt2, mode, freeze, *steps, "trainer.max_steps=4"), tmp_path / "whole")
    run(_cfg(gpt2, mode, freeze, *steps), tmp_path / "half")
    saved = load_last(tmp_path / "half")["model"]
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in own.items()}
    pretrained = transformers.GPT2LMHeadModel.from_pretrained(gpt2[0]).state_dict()
    for name in ("c_attn.weight", "c_attn.bias", "c_proj.weight"):
        assert torch.equal(
            saved[f"{BLOCK}.attn.{name}"], pretrained[f"transformer.h.0.attn.{name}"]
        )
    assert not torch.equal(
        saved[f"{BLOCK}.mlp.c_fc.weight"], pretrained["transformer.h.0.mlp.c_fc.weight"]
    )

    last = tmp_path / "half" / "checkpoints" / "last.pt"
    across = [*steps, "trainer.max_steps=4", f"trainer.resume={last}"]
    bf16 = run(
        _cfg(gpt2, "bf16", freeze, *across, "trainer.resume_across_precision=true"),
        tmp_path / "bf16",
    )
    assert bf16["status"] == "completed" and bf16["steps"] == 4
    resumed = run(_cfg(gpt2, mode, freeze, *across), tmp_path / "resumed")
    assert resumed["final_loss"] == whole["final_loss"]


def test_an_fp16_master_checkpoint_resumes_in_fp8(tmp_path, gpt2):
    """Its fp32 masters (in GPT-2's Conv1D layout, as every checkpoint) go into the converted
    Linears' weights, each in its place (c_proj's square weight too), and the run goes on."""
    run(_cfg(gpt2, "fp16_master"), tmp_path / "fp16")
    last = tmp_path / "fp16" / "checkpoints" / "last.pt"
    state = torch.load(last, weights_only=True)
    cfg = _cfg(gpt2, "fp8", f"trainer.resume={last}", "trainer.resume_across_precision=true")
    task, precision, _ = _prepared(cfg)
    task.load_state_dict(state["model"])
    convert_precision(state, task, precision, allowed=True)
    # fp16_master's masters: one per weight it held in fp16, in the model's order
    owners = [n for n, _ in task.named_parameters() if state["model"][n].dtype == torch.float16]
    weights, masters = task.state_dict(), state["master_weights"]
    assert any(weights[n].shape == (32, 32) for n in owners)  # attn.c_proj: square
    assert all(torch.equal(weights[n], m) for n, m in zip(owners, masters, strict=True))
    resumed = run(OmegaConf.merge(cfg, {"trainer": {"max_steps": 3}}), tmp_path / "fp8")
    assert resumed["status"] == "completed" and resumed["steps"] == 3
