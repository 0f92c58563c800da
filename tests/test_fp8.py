"""precision=fp8 (torchao float8 training, emulated on a CPU): which Linears convert, what the
audit counts, convergence next to bf16, exact resume, staged and islands; precision=mxfp8 (its
block-scaled format, test_mxfp8.py) shares the rules, so the tests that are not about float8's
kernels run in both. With compile, DDP and FSDP (two ranks of b against one process of 2b) both
run in the pairwise matrix (test_matrix.py)."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from runner.config import Fp8Config
from runner.errors import UserError
from runner.precision import Precision
from runner.precision.fp8 import RECIPES, Float8
from runner.run import build, run
from tests.helpers import TINY_BERT, make_cfg, read_metrics

pytest.importorskip("torchao")

FP8 = ["precision=fp8", "precision.fp8.min_features=16"]
# Each format's overrides, the recipe a CPU runs, and torchao's converted layer class
FORMATS = {
    "fp8": (FP8, "tensorwise", "torchao.float8.float8_linear.Float8Linear"),
    "mxfp8": (
        ["precision=mxfp8", "precision.fp8.min_features=16"],
        "mxfp8_emulated_rceil",
        "torchao.prototype.moe_training.mxfp8_linear.MXFP8Linear",
    ),
}
# A tiny BERT whose Linears have dimensions that are multiples of 16 (fp8 GEMMs need it).
BERT = [*TINY_BERT, "trainer.max_steps=4", "trainer.log_every_n_steps=1"]
GPT = [
    "model=gpt",
    "model.n_embd=32",
    "model.n_layer=1",
    "model.n_head=2",
    "model.dropout=0",
    *[o for o in BERT if o.startswith(("dataset.", "trainer.", "logger"))],
]
LAYER = "model.bert.encoder.layer.0"


def _layer_class(dotted: str) -> type:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("mode", FORMATS)
def test_the_linears_convert_as_configured(tmp_path, mode):
    overrides, recipe, _ = FORMATS[mode]
    cfg = make_cfg(*BERT, *overrides, "precision.fp8.skip=[first,last,'*.output.dense']")
    fp8 = run(cfg, tmp_path)["converted"]
    assert fp8["recipe"] == recipe
    assert sorted(fp8["converted"]) == [
        f"{LAYER}.attention.self.key",
        f"{LAYER}.attention.self.value",
        f"{LAYER}.intermediate.dense",
        "model.cls.predictions.transform.dense",
    ]
    assert fp8["skipped"][f"{LAYER}.attention.self.query"].startswith("the first Linear")
    assert fp8["skipped"]["model.cls.predictions.decoder"].startswith("the last Linear")
    for name in (f"{LAYER}.output.dense", f"{LAYER}.attention.output.dense"):
        assert "matches '*.output.dense'" in fp8["skipped"][name]


@pytest.mark.parametrize("mode", FORMATS)
def test_the_layers_reported_converted_are_torchaos_converted_class(mode):
    overrides, _, dotted = FORMATS[mode]
    layer = _layer_class(dotted)
    cfg = make_cfg(*BERT, *overrides, "precision.fp8.skip=[first,last,'*.output.dense']")
    _, task = build(cfg)
    precision = Precision(cfg.precision, torch.device("cpu"))
    precision.prepare(task, cfg.precision.fp32_modules)
    converted = {n for n, m in task.named_modules() if isinstance(m, layer)}
    assert len(converted) == 4 and set(precision.converted.report()["converted"]) == converted
    assert not any(isinstance(task.get_submodule(n), layer) for n in precision.converted.skipped)


@pytest.mark.parametrize("mode", FORMATS)
def test_fp8_computes_other_numbers_than_bf16(tmp_path, mode):
    """The same run in bf16 autocast: every loss differs (the first one too: fp8's forward)."""
    cfg = [*BERT, "trainer.max_steps=2"]
    run(make_cfg(*cfg, "precision=bf16"), tmp_path / "bf16")
    run(make_cfg(*cfg, *FORMATS[mode][0]), tmp_path / "fp8")
    bf16, fp8 = (read_metrics(tmp_path / mode) for mode in ("bf16", "fp8"))
    assert all(a["loss"] != b["loss"] for a, b in zip(bf16, fp8, strict=True))


@pytest.mark.parametrize("recipe", RECIPES)
def test_rows_that_are_not_a_multiple_of_16_are_padded_for_the_fp8_gemms(
    tmp_path, monkeypatch, recipe
):
    """A micro-batch of 20 rows: the weight's gradient GEMM sums over them, and _scaled_mm on a
    GPU needs that inner dimension to be a multiple of 16 (a CPU does not: the shapes are read).
    rowwise_with_gw_hp computes that GEMM in bf16, without _scaled_mm."""
    shapes = []
    scaled_mm = torch._scaled_mm

    def recording(a, b, *args, **kwargs):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        return scaled_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    cfg = [
        "model=module",
        "model.net._target_=tests.test_matrix.MatrixNet",  # Linear 32→64, 64→64, head 64→8
        "dataset=blobs",
        "dataset.num_samples=256",
        "dataset.batch_size=20",
        "trainer.max_steps=2",
        "trainer.progress_bar=false",
        "logger=none",
        *FP8,
        "precision.fp8.skip=[]",
        f"precision.fp8.recipe={recipe}",
    ]
    assert run(make_cfg(*cfg), tmp_path)["status"] == "completed"
    inner = {a[1] for a, _ in shapes}
    assert 20 not in inner and all(k % 16 == 0 for k in inner), shapes
    if recipe != "rowwise_with_gw_hp":
        assert (64, 32) in {a for a, _ in shapes}  # the weight's gradient: 64 × 32 padded rows


@pytest.mark.parametrize("recipe", RECIPES)
def test_zero_rows_padded_in_change_no_output_and_no_gradient(recipe):
    """Against torchao's own forward on the 20 rows as they are (a CPU runs that), its input in
    autocast's bf16: bit for bit, in every recipe."""
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
    fp8 = Float8(Fp8Config(recipe=recipe, skip=[], min_features=16))
    fp8.prepare(net, [])
    fp8.active = True
    x = torch.randn(4, 5, 32, requires_grad=True)

    def step(forward) -> list[torch.Tensor]:
        net.zero_grad()
        x.grad = None
        with torch.autocast("cpu", torch.bfloat16):
            out = forward(x)
        out.float().pow(2).sum().backward()
        return [out.detach(), x.grad, *(p.grad for p in net.parameters())]

    padded = step(net)
    plain = step(lambda x: Float8Linear.forward(net[1], Float8Linear.forward(net[0], x.bfloat16())))
    assert all(torch.equal(a, b) for a, b in zip(padded, plain, strict=True))


@pytest.mark.parametrize("mode", FORMATS)
def test_the_audit_counts_the_fp8_gemms(tmp_path, mode):
    """And none of them as fp32 (MXFP8's tensors have the dtype they stand for: fp32)."""
    summary = run(make_cfg(*BERT, *FORMATS[mode][0]), tmp_path)
    fp8 = summary["converted"]
    assert fp8["converted_flops_per_step"] > 0
    assert 0 < fp8["converted_flop_share"] < summary["low_precision_flop_share"] <= 1
    assert summary["fp32_ops"] == {}


def test_small_or_odd_layers_stay_bf16(tmp_path):
    cfg = make_cfg(
        *BERT, "precision=fp8", "precision.fp8.min_features=64", "dataset.vocab_size=500"
    )
    fp8 = run(cfg, tmp_path)["converted"]
    assert "not multiples of 16" in fp8["skipped"]["model.cls.predictions.decoder"]
    assert "min_features=64" in fp8["skipped"][f"{LAYER}.attention.self.key"]


@pytest.mark.parametrize("mode", FORMATS)
@pytest.mark.parametrize("model", ["bert", "gpt"])
def test_fp8_trains_to_within_3_percent_of_bf16(tmp_path, model, mode):
    sizes = BERT if model == "bert" else GPT
    steps = ["trainer.max_steps=10", "trainer.val_check_interval=10", "trainer.limit_val_batches=2"]
    cfg = [*sizes, *steps, "optim.optimizer.lr=3e-3"]
    bf16 = run(make_cfg(*cfg, "precision=bf16"), tmp_path / "bf16")
    fp8 = run(make_cfg(*cfg, *FORMATS[mode][0]), tmp_path / "fp8")
    assert fp8["converted"]["converted"]
    assert abs(fp8["eval_loss"] - bf16["eval_loss"]) < 0.03 * bf16["eval_loss"]


@pytest.mark.parametrize("mode", FORMATS)
def test_a_checkpoint_resumes_bit_exact(tmp_path, mode):
    cfg = [*BERT, *FORMATS[mode][0], "optim.optimizer.fused=false"]
    whole = run(make_cfg(*cfg, "trainer.max_steps=6"), tmp_path / "whole")
    run(make_cfg(*cfg, "trainer.max_steps=3"), tmp_path / "resumed")
    resumed = run(
        make_cfg(*cfg, "trainer.max_steps=6", "trainer.resume=auto"), tmp_path / "resumed"
    )
    assert resumed["final_loss"] == whole["final_loss"]


@pytest.mark.parametrize("mode", FORMATS)
def test_a_staged_run_computes_in_fp8_only_in_its_fp8_stage(tmp_path, mode):
    """fp32 for steps 1–2, then fp8: the first two steps are those of an fp32 run."""
    stages = f"precision.stages=[{{mode:fp32,until_step:2}},{{mode:{mode}}}]"
    staged = [*BERT, "precision=staged", stages, "precision.fp8.min_features=16"]
    run(make_cfg(*staged), tmp_path / "staged")
    run(make_cfg(*BERT, "precision=fp32"), tmp_path / "fp32")
    rows, fp32 = read_metrics(tmp_path / "staged"), read_metrics(tmp_path / "fp32")
    assert [r["loss"] for r in rows[:2]] == [r["loss"] for r in fp32[:2]]
    assert rows[2]["loss"] != fp32[2]["loss"] and rows[2]["precision"] == mode


@pytest.mark.parametrize("mode", FORMATS)
def test_an_island_stays_high_precision(tmp_path, mode):
    cfg = make_cfg(*BERT, *FORMATS[mode][0], f"precision.fp32_modules=[{LAYER}.intermediate]")
    summary = run(cfg, tmp_path)
    assert summary["converted"]["skipped"][f"{LAYER}.intermediate.dense"] == "inside an fp32 island"
    assert f"{LAYER}.output.dense" in summary["converted"]["converted"]


def test_a_bad_recipe_is_one_clear_line(tmp_path):
    with pytest.raises(UserError, match="precision.fp8.recipe='e5m2' is invalid: allowed"):
        run(make_cfg(*BERT, "precision=fp8", "precision.fp8.recipe=e5m2"), tmp_path)
