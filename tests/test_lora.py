"""model.peft: LoRA fine-tunes of a tiny Llama (transformers, saved with `save_pretrained`) and of a
user's net, in each precision: only the adapters train, the frozen base holds the mode's dtype and
the adapters precision.adapter_dtype's, the checkpoint holds the adapters and leaves the base out
(a resume onto another base refused), and the exported adapters load back in `peft` alone."""

from __future__ import annotations

import json
import subprocess
import sys

import peft
import pytest
import torch
import transformers

from runner.errors import UserError
from runner.export import export
from runner.run import run
from tests.helpers import load_last, make_cfg, module_run, read_metrics
from tests.test_hf import causal_lm_on_text, hf
from tests.test_norms import llama  # noqa: F401 (the fixture: a tiny Llama and a corpus)

LORA = "model.peft={r:4,alpha:8,target_modules:[q_proj,v_proj]}"
ADAPTERS = 4  # q_proj and v_proj of one layer, an A and a B each
# The dtype the frozen base holds by mode: mixed modes keep fp32 weights under autocast.
BASE = {"fp32": "fp32", "bf16": "fp32", "fp16": "fp32", "bf16_true": "bf16", "fp16_master": "fp16"}
TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# lr high enough that 3 steps move the adapters well beyond bf16's rounding
STEPS = [
    "trainer.max_steps=3",
    "optim.optimizer.lr=0.01",
    "optim.scheduler.warmup_steps=0",
    "optim.scheduler.decay=constant",
]


def lora_cfg(folder, text, *overrides: str):
    return hf(
        folder,
        *causal_lm_on_text(text),
        "dataset.seq_len=16",
        "dataset.batch_size=4",
        "trainer.val_check_interval=0",
        LORA,
        *STEPS,
        *overrides,
    )


def lora_run(folder, text, out, *overrides: str) -> dict:
    summary = run(lora_cfg(folder, text, *overrides), out)
    assert summary["status"] == "completed", summary.get("error")
    return summary


def base_weights(folder, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The saved Llama's weights as the run names them (under PEFT's wrapper), in `dtype` (its
    norms in fp32, as every mode keeps them)."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = {}
    for name, p in model.named_parameters():
        name = name.replace("q_proj.", "q_proj.base_layer.").replace(
            "v_proj.", "v_proj.base_layer."
        )
        out[f"net.base_model.model.{name}"] = p.detach().to("norm" in name and p.dtype or dtype)
    return out


@pytest.mark.parametrize(
    "mode, adapter_dtype",
    [
        ("fp32", "fp32"),
        ("bf16", "fp32"),
        ("fp16", "fp32"),
        ("bf16_true", "fp32"),
        ("bf16_true", "base"),
        ("fp16_master", "base"),
    ],
)
def test_only_the_adapters_train_in_their_dtype(tmp_path, llama, mode, adapter_dtype):  # noqa: F811
    folder, text = llama
    summary = lora_run(
        folder, text, tmp_path, f"precision={mode}", f"precision.adapter_dtype={adapter_dtype}"
    )
    state = load_last(tmp_path)
    # The checkpoint: the adapters alone, in their dtype, moved from their init (B starts at 0).
    adapters = dict(state["model"])
    assert len(adapters) == ADAPTERS and all(".lora_" in k for k in adapters), list(adapters)
    held = BASE[mode] if adapter_dtype == "base" else "fp32"
    assert {v.dtype for v in adapters.values()} == {TORCH[held]}
    assert all(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)
    assert len(state["optimizer"]["state"]) == ADAPTERS  # the optimizer saw nothing else
    if mode == "fp16_master":  # masters for the fp16 adapters only, none for the frozen base
        assert [m.shape for m in state["master_weights"]] == [v.shape for v in adapters.values()]
    # The base at the last step is the saved Llama in the mode's dtype: its digests match.
    expected = base_weights(folder, TORCH[BASE[mode]])
    digests = state["frozen_base"]
    assert set(digests) == set(expected)
    for name, (dtype, total, _) in digests.items():
        assert dtype == str(expected[name].dtype).removeprefix("torch.")
        assert total == pytest.approx(float(expected[name].sum(dtype=torch.float64)), rel=1e-9)
    # Precision truth and memory show the two parts apart, in the dtypes the tensors hold.
    truth = summary["precision_truth"]
    assert truth["mismatches"] == []
    parts = {(r["part"], r["weights"]) for r in truth["rows"] if not r["norm"]}
    assert parts == {("adapter", held), ("frozen", BASE[mode])}
    memory = summary["memory"]
    low = str(TORCH[BASE[mode]]).removeprefix("torch.")
    assert max(memory["frozen"]["by_dtype"], key=memory["frozen"]["by_dtype"].get) == low
    adapter_bytes = sum(v.numel() * v.element_size() for v in adapters.values())
    assert memory["params"]["mb"] == adapter_bytes / 2**20
    assert summary["trainable_parameters"] == summary["peft"]["adapter_parameters"] == 512


def test_a_bf16_base_halves_the_frozen_weights_at_a_loss_gap(tmp_path, llama):  # noqa: F811
    """What the sweep answers: bf16_true's base takes half of fp32's memory, and its loss is
    a different one (the base's rounding shows in the forward)."""
    folder, text = llama
    fp32 = lora_run(folder, text, tmp_path / "fp32", "precision=fp32")
    bf16 = lora_run(folder, text, tmp_path / "bf16_true", "precision=bf16_true")
    norms = 3 * 32 * 4 / 2**20  # three RMSNorm weights stay fp32
    frozen = fp32["memory"]["frozen"]["mb"]
    assert bf16["memory"]["frozen"]["mb"] == pytest.approx((frozen - norms) / 2 + norms)
    assert bf16["memory"]["params"] == fp32["memory"]["params"]  # fp32 adapters in both
    assert bf16["final_loss"] != fp32["final_loss"]


def test_a_resume_continues_and_refuses_another_base(tmp_path, llama):  # noqa: F811
    folder, text = llama
    whole = lora_run(folder, text, tmp_path / "whole", "precision=bf16_true")
    part = tmp_path / "part"
    lora_run(folder, text, part, "precision=bf16_true", "trainer.max_steps=2")
    lora_run(folder, text, part, "precision=bf16_true", "trainer.resume=auto")
    assert [r["loss"] for r in read_metrics(part)] == [
        r["loss"] for r in read_metrics(tmp_path / "whole")
    ]
    assert whole["final_loss"] == read_metrics(part)[-1]["loss"]
    # The same run's checkpoint onto a Llama trained further: refused, not a different model.
    other = tmp_path / "other"
    model = transformers.LlamaForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.01)
    model.save_pretrained(other)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (other / name).write_bytes((folder / name).read_bytes())
    last = part / "checkpoints" / "last.pt"
    cfg = lora_cfg(
        other, text, "precision=bf16_true", "trainer.max_steps=4", f"trainer.resume={last}"
    )
    with pytest.raises(UserError, match="trained on another frozen base: .*down_proj"):
        run(cfg, tmp_path / "resumed")


def test_exported_adapters_load_back_in_peft(tmp_path, llama):  # noqa: F811
    folder, text = llama
    lora_run(folder, text, tmp_path, "precision=bf16_true")
    out = export(tmp_path)
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    base = transformers.LlamaForCausalLM.from_pretrained(folder)
    ids = torch.arange(16).unsqueeze(0)
    before = base(ids).logits
    loaded = peft.PeftModel.from_pretrained(base, out)
    trained = {k.removeprefix("net."): v for k, v in load_last(tmp_path)["model"].items()}
    got = {k: v for k, v in loaded.state_dict().items() if ".lora_" in k}
    assert set(got) == set(trained)
    for name, value in trained.items():
        assert torch.equal(got[name], value)  # fp32 adapters, as trained
    assert not torch.allclose(loaded(ids).logits, before)  # they change what the model says


def test_export_of_a_run_without_adapters_is_one_line(tmp_path, llama):  # noqa: F811
    folder, text = llama
    cfg = hf(
        folder,
        *causal_lm_on_text(text),
        "dataset.seq_len=16",
        "dataset.batch_size=4",
        "trainer.val_check_interval=0",
        "trainer.max_steps=1",
    )
    assert run(cfg, tmp_path)["status"] == "completed"
    done = subprocess.run(
        [sys.executable, "-m", "runner.export", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'checkpoints' / 'last.pt'} holds no adapters: its run did not set "
        "model.peft"
    ]


def test_a_users_net_takes_lora_with_checkpointing(tmp_path):
    """model=module: LoRA on a user's Linears, their blocks recomputed in backward, in
    bf16_true: the adapters fp32, the rest bf16 but its norms."""
    overrides = module_run(
        "tests.test_norms.OwnNormNet",
        "+model.peft.r=2",
        "+model.peft.target_modules=[blocks.0.0,blocks.1.0]",
        "model.gradient_checkpointing=true",
        "precision=bf16_true",
    )
    summary = run(make_cfg(*overrides), tmp_path)
    assert summary["status"] == "completed"
    model = load_last(tmp_path)["model"]
    assert {k: v.dtype for k, v in model.items()} == {
        f"net.base_model.model.blocks.{i}.0.lora_{ab}.default.weight": torch.float32
        for i in (0, 1)
        for ab in "AB"
    }
    assert summary["precision_truth"]["mismatches"] == []


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.peft={r:0}"], "model.peft.r=0 is invalid: must be an integer ≥ 1"),
        (["model.peft={rank:4}"], "model.peft.rank=4 is invalid: not a LoRA setting"),
        (
            ["model.peft={dropout:1.5}"],
            r"model.peft.dropout=1.5 is invalid: must be a number in \[0, 1\)",
        ),
        (["model.peft={alpha:8,lora_alpha:8}"], "set once: alpha or lora_alpha"),
        (["model.peft=4"], "model.peft=4 is invalid: null or a mapping"),
        (
            [LORA, "precision.adapter_dtype=bf16"],
            "precision.adapter_dtype='bf16' is invalid: allowed: fp32, base",
        ),
    ],
)
def test_bad_lora_settings_are_one_clear_line(tmp_path, llama, overrides, message):  # noqa: F811
    folder, text = llama
    with pytest.raises(UserError, match=message):
        run(hf(folder, *causal_lm_on_text(text), "dataset.seq_len=16", *overrides), tmp_path)


def test_a_net_peft_cannot_adapt_is_one_clear_line(tmp_path):
    """A user's net has no module names PEFT knows: it must be told target_modules."""
    overrides = module_run("tests.test_norms.OwnNormNet", "+model.peft.r=2")
    with pytest.raises(UserError, match="model.peft cannot adapt OwnNormNet: .*target_modules"):
        run(make_cfg(*overrides), tmp_path)


def test_the_comparison_shows_base_and_trained_memory(tmp_path, llama):  # noqa: F811
    """A sweep's rows: the base's MB and what trains, apart (a bf16 base is half, its adapters
    as fp32's)."""
    from omegaconf import OmegaConf

    from runner.compare.sweep import compare

    folder, text = llama
    for i, mode in enumerate(("fp32", "bf16_true")):
        job = tmp_path / str(i)
        lora_run(folder, text, job, f"precision={mode}")
        (job / ".hydra").mkdir()
        OmegaConf.save({"precision": {"mode": mode}}, job / ".hydra" / "config.yaml")
    rows = {g.precision: g.figures for g in compare(tmp_path, wandb_log=False)}
    fp32, bf16 = rows["fp32"], rows["bf16_true"]
    assert bf16["frozen_mb"] < 0.6 * fp32["frozen_mb"]
    assert bf16["trained_mb"] == fp32["trained_mb"] > 0
    header = (tmp_path / "compare.md").read_text().splitlines()[2]
    assert "| base MB | trained MB |" in header


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
def test_lora_trains_under_ddp_and_fsdp(tmp_path):
    """Two ranks: the adapters train and the base stays frozen, averaged by DDP and sharded by
    FSDP alike; DDP's checkpoint holds the adapters alone (FSDP's set, DCP's, holds all)."""
    from tests.test_distributed import run_ranks

    jobs = [
        (
            module_run(
                "tests.test_norms.OwnNormNet",
                "+model.peft.r=2",
                "+model.peft.target_modules=[blocks.0.0,blocks.1.0]",
                "precision=bf16",
                f"trainer.strategy={strategy}",
                "trainer.device=cpu",
            ),
            tmp_path / strategy,
        )
        for strategy in ("ddp", "fsdp")
    ]
    for folder in (tmp_path / "ddp", tmp_path / "fsdp"):
        folder.mkdir()
    reports = run_ranks(jobs)
    assert [r["outcome"] for job in reports for r in job] == ["completed"] * 4
    for _, folder in jobs:
        truth = json.loads((folder / "summary.json").read_text())["precision_truth"]
        assert truth["mismatches"] == []
        trains = {r["part"]: r["grads"] for r in truth["rows"]}
        assert trains == {"adapter": "fp32", "frozen": None}
    model = load_last(tmp_path / "ddp")["model"]
    assert len(model) == ADAPTERS and all(".lora_" in k for k in model)
