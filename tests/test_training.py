"""The loop: same weights as PyTorch's documented AMP recipe, accumulation that equals a bigger
batch, evaluation, and the run-output contract."""

from __future__ import annotations

import json
import math

import pytest
import torch

from runner.run import build, run, seed_everything
from tests.helpers import TINY_BERT, TINY_MLP, load_last, make_cfg, read_metrics, unigram_entropy

# Constant LR and no weight decay, so that the reference needs nothing but torch.optim.AdamW.
PLAIN_OPTIM = [
    "optim.scheduler.decay=constant",
    "optim.scheduler.warmup_steps=0",
    "optim.optimizer.weight_decay=0",
    "trainer.gradient_clip_val=1.0",
]


def reference_loop(cfg, steps: int, mode: str) -> dict[str, torch.Tensor]:
    """The textbook AMP loop (torch.autocast + torch.amp.GradScaler), written out by hand."""
    seed_everything(cfg.seed)
    data, model = build(cfg)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.optimizer.lr,
        betas=tuple(cfg.optim.optimizer.betas),
        eps=cfg.optim.optimizer.eps,
        weight_decay=0.0,
        fused=cfg.optim.optimizer.fused,  # scaler.step hands fused AdamW the scale and inf flag
    )
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mode)
    scaler = torch.amp.GradScaler("cpu", enabled=mode == "fp16")
    batches = iter(data.train_loader())
    for _ in range(steps):
        batch = next(batches)
        n = int((batch["labels"] != -100).sum())
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(batch) / n
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return model.state_dict()


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16"])
def test_runner_ends_with_the_same_weights_as_the_reference_loop(tmp_path, mode):
    # PyTorch's own kernels on both sides: the loop is what is compared (the fast CPU kernels
    # round as they do, summed in another order: tests/test_cpu_kernels.py)
    cfg = make_cfg(
        *TINY_BERT,
        *PLAIN_OPTIM,
        f"precision={mode}",
        "precision.cpu_kernels=native",
        "trainer.max_steps=6",
    )
    run(cfg, tmp_path)
    expected = reference_loop(cfg, 6, mode)
    got = load_last(tmp_path)["model"]
    initial_seed = cfg.seed
    seed_everything(initial_seed)
    _, untrained = build(cfg)
    moved = 0
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
        moved += not torch.equal(tensor, untrained.state_dict()[name])
    assert moved > len(expected) // 2  # the comparison is of trained weights


def test_accumulation_equals_one_bigger_batch(tmp_path):
    """accumulate_grad_batches=4 × batch 4 ≡ 1 × batch 16: loss normalised by masked tokens over
    the whole window, masks fixed per sample, samples in the same order."""
    common = [*TINY_BERT, "trainer.max_steps=4", "trainer.log_every_n_steps=1"]
    run(
        make_cfg(*common, "trainer.accumulate_grad_batches=4", "dataset.batch_size=4"),
        tmp_path / "a",
    )
    run(
        make_cfg(*common, "trainer.accumulate_grad_batches=1", "dataset.batch_size=16"),
        tmp_path / "b",
    )
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)
    wa, wb = load_last(tmp_path / "a")["model"], load_last(tmp_path / "b")["model"]
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-4, atol=1e-5, msg=name)
    different_batch = read_metrics(tmp_path / "a")[0]["loss"]
    run(make_cfg(*common, "dataset.batch_size=4"), tmp_path / "c")
    assert read_metrics(tmp_path / "c")[0]["loss"] != pytest.approx(different_batch, rel=1e-5)


def test_run_outputs_follow_the_contract(tmp_path):
    cfg = make_cfg(
        *TINY_BERT,
        "precision=bf16",
        "trainer.max_steps=7",
        "trainer.log_every_n_steps=3",
        "trainer.val_check_interval=3",
        "trainer.checkpoint_every_n_steps=5",
    )
    summary = run(cfg, tmp_path)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 8))  # one row per optimizer step
    for r in rows:
        assert {
            "step",
            "loss",
            "grad_norm",
            "loss_scale",
            "skipped",
            "lr",
            "step_time_s",
            "samples_per_s",
            "tokens_per_s",
        } <= set(r)
        assert isinstance(r["loss"], float) and isinstance(r["skipped"], bool)
        assert r["loss_scale"] == 1.0 and r["samples_per_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 32)
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6, 7]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["steps"] == summary["steps"] == 7
    for key in (
        "final_loss",
        "skipped_steps",
        "samples_per_s",
        "peak_memory_mb",
        "precision",
        "device",
        "eval_loss",
        "eval_accuracy",
    ):
        assert key in on_disk, key
    assert on_disk["precision"] == "bf16" and on_disk["skipped_steps"] == 0
    assert on_disk["final_loss"] == rows[-1]["loss"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.pt", "step-5.pt"]
    assert load_last(tmp_path)["step"] == 7


@pytest.mark.slow  # over 30 s on 2 cores: make test stays under 10 minutes
def test_generated_corpus_is_learnable(tmp_path):
    """The MLM loss falls well below the unigram entropy of the training tokens: the data has
    structure a model can learn, so a precision that hurts learning shows up. The corpus is what
    is tested, so the model trains in fp32 (bf16 and fp16 are emulated, and slow, on many CPUs)."""
    cfg = make_cfg(
        *TINY_BERT,  # the small corpus most tests train on, and a model that can learn it
        "model.hidden_size=128",
        "model.num_hidden_layers=2",
        "model.intermediate_size=256",
        "dataset.batch_size=32",
        "optim.optimizer.lr=2e-3",
        "precision=fp32",
        "trainer.max_steps=300",
        "trainer.val_check_interval=300",
    )
    summary = run(cfg, tmp_path)
    data, _ = build(cfg)
    entropy = unigram_entropy(data)
    assert math.isfinite(summary["eval_loss"])
    assert summary["eval_loss"] < 0.75 * entropy, (summary["eval_loss"], entropy)


def test_compiled_runs_compile_and_match_eager(tmp_path):
    """The compiled run really compiles (the first step's audit runs eagerly, and must not make
    Dynamo skip the forward for good), and trains like the eager one."""
    common = [*TINY_MLP, "precision=bf16", "trainer.max_steps=3", "trainer.log_every_n_steps=1"]
    eager = run(make_cfg(*common), tmp_path / "eager")
    compiled = run(make_cfg(*common, "trainer.compile=true"), tmp_path / "compiled")
    assert eager["compiled_graphs"] == 0 and compiled["compiled_graphs"] >= 1
    assert compiled["graph_breaks"] == 0
    rows, ref = read_metrics(tmp_path / "compiled"), read_metrics(tmp_path / "eager")
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=2e-2)
    names = set(load_last(tmp_path / "compiled")["model"])
    assert names == set(load_last(tmp_path / "eager")["model"])  # no _orig_mod. prefixes


def test_fused_adamw_matches_foreach(tmp_path):
    common = [*TINY_MLP, "trainer.max_steps=4", "trainer.log_every_n_steps=1"]
    fused = run(make_cfg(*common, "optim.optimizer.fused=true"), tmp_path / "fused")
    foreach = run(make_cfg(*common, "optim.optimizer.fused=false"), tmp_path / "foreach")
    a, b = load_last(tmp_path / "fused"), load_last(tmp_path / "foreach")
    assert a["optimizer"]["param_groups"][0]["fused"] is True
    assert b["optimizer"]["param_groups"][0]["fused"] is False
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, rtol=1e-5, atol=1e-6)
    assert fused["final_loss"] == pytest.approx(foreach["final_loss"], rel=1e-5)
