"""runner.eval_precisions: the final weights evaluated in each precision, against fp32. The figures
are checked against the test's own evaluation of the checkpointed weights (cast by hand with
`.half()`, as people deploy), not against what the runner says of itself."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import TensorDataset

from runner.answers.inference import evaluate_precisions
from runner.answers.inference_weights import cast_copy
from runner.compare import compare
from runner.errors import UserError
from runner.precision import Precision, fp32_islands
from runner.run import build, run
from runner.train.evaluation import Evaluation, Variant, evaluating
from runner.train.evaluation import run as evaluation_run
from tests.helpers import TINY_BERT, TINY_MLP, load_last, make_cfg

HERE = "tests.test_inference_precision"
EVERY = "runner.eval_precisions=[fp32,bf16,fp16,fp16_cast,bf16_cast]"
QUIET = ["trainer.progress_bar=false", "logger=none"]


# -- a BatchNorm net on raw features: the articles' warning about .half() at inference ---------


class RawFeatureNet(nn.Module):
    """BatchNorm first, normalising raw features of order 1e5 (prices, counts). In fp32, and under
    autocast (the first layer sees fp32 inputs), fine; cast with .half(), the inputs and the
    running mean pass fp16's largest value, 65504."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(8)
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 3))

    def forward(self, x):
        return self.body(self.norm(x))


def raw_features(n: int = 256, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 8, generator=g)
    y = (z[:, 0] > 0).long() + (z[:, 1] > 0.5).long()
    return TensorDataset(1e5 + 3e4 * z, y)


def raw_cfg(*overrides: str):
    return make_cfg(
        "model=module",
        f"model.net._target_={HERE}.RawFeatureNet",
        f"dataset.train._target_={HERE}.raw_features",
        f"dataset.validation._target_={HERE}.raw_features",
        "+dataset.validation.seed=1",
        "dataset.batch_size=32",
        "trainer.max_steps=30",
        "trainer.val_check_interval=30",
        "trainer.limit_val_batches=4",
        *QUIET,
        *overrides,
    )


def test_a_batchnorm_net_that_overflows_cast_to_fp16_is_a_row_not_a_crash(tmp_path):
    summary = run(raw_cfg(EVERY), tmp_path)
    assert summary["status"] == "completed"
    rows = summary["eval_precisions"]
    assert list(rows) == ["fp32", "bf16", "fp16", "fp16_cast", "bf16_cast"]
    # The test's own deployment: the checkpointed weights, .half(), fed .half() inputs.
    net = RawFeatureNet()
    net.load_state_dict(
        {k.removeprefix("net."): v for k, v in load_last(tmp_path)["model"].items()}
    )
    x = raw_features(128, seed=1).tensors[0]
    assert not torch.isfinite(net.eval().half()(x.half())).all()
    assert rows["fp16_cast"]["status"] == "overflow"
    assert all(math.isnan(v) for v in rows["fp16_cast"]["metrics"].values())
    for name in ("fp32", "bf16", "fp16", "bf16_cast"):  # autocast keeps the norm's input fp32
        assert rows[name]["status"] == "ok", (name, rows[name])
        assert all(math.isfinite(v) for v in rows[name]["metrics"].values())
    # bf16 holds 1e5 to within 512: cast, the norm's inputs are rounded too, not only matmuls'.
    assert rows["bf16_cast"]["kl_mean"] > rows["bf16"]["kl_mean"] > 0
    written = json.loads((tmp_path / "summary.json").read_text())["eval_precisions"]
    assert written["fp16_cast"]["status"] == "overflow"


# -- the zoo's BatchNorm models: the figures against the test's own .half() evaluation ---------

VISION = {
    "resnet": [
        "model=resnet",
        "model.width=8",
        "model.blocks_per_stage=[1,1]",
        "dataset.image_size=16",
    ],
    "unet": ["model=unet", "model.width=4", "model.depth=2", "dataset.image_size=16"],
}


def _kl(reference: torch.Tensor, ours: torch.Tensor) -> torch.Tensor:
    """KL(reference ‖ ours) of the softmax over dim 1, summed over everything else."""
    log_r, log_o = F.log_softmax(reference.double(), 1), F.log_softmax(ours.double(), 1)
    return (log_r.exp() * (log_r - log_o)).sum()


@pytest.mark.parametrize("model", ["resnet", "unet"])
def test_a_cast_batchnorm_model_is_measured_as_the_test_measures_it(tmp_path, model):
    """ResNet: classes, compared by KL; UNet: segmentation logits, by each image's relative
    error. The fp16_cast figures equal the test's evaluation of the checkpoint cast by .half()."""
    cfg = make_cfg(
        *VISION[model],
        "dataset.batch_size=16",
        "trainer.max_steps=12",
        "trainer.val_check_interval=12",
        "trainer.limit_val_batches=2",
        EVERY,
        *QUIET,
    )
    summary = run(cfg, tmp_path)
    rows = summary["eval_precisions"]
    assert all(r["status"] == "ok" for r in rows.values()), rows
    assert rows["fp32"]["metrics"]["eval_loss"] == pytest.approx(summary["eval_loss"], rel=1e-6)
    data, task = build(cfg)
    task.load_state_dict(load_last(tmp_path)["model"])
    half = copy.deepcopy(task).eval().half()
    images, losses, kl, relative = 0, 0.0, 0.0, []
    with torch.no_grad():
        for batch in data.val_loader(2):
            target = batch["label" if model == "resnet" else "mask"]
            reference = task.eval().logits(batch)
            ours = half.logits({"image": batch["image"].half()}).float()
            losses += F.cross_entropy(ours, target, reduction="sum").item()
            images += target.numel()
            kl += _kl(reference, ours).item()
            relative += (
                (ours - reference).flatten(1).norm(dim=1) / reference.flatten(1).norm(dim=1)
            ).tolist()
    cast = rows["fp16_cast"]
    assert cast["metrics"]["eval_loss"] == pytest.approx(losses / images, rel=1e-4)
    assert cast["change"]["eval_loss"] == pytest.approx(
        losses / images - rows["fp32"]["metrics"]["eval_loss"], abs=1e-5
    )
    if model == "resnet":
        assert cast["kl_mean"] == pytest.approx(kl / images, rel=1e-3)
        assert rows["bf16"]["kl_mean"] > rows["fp16"]["kl_mean"] > 0  # bf16: 3 bits less
    else:
        assert cast["rel_error_max"] == pytest.approx(max(relative), rel=1e-3)
        assert cast["rel_error_mean"] == pytest.approx(sum(relative) / len(relative), rel=1e-3)
        assert rows["bf16_cast"]["rel_error_mean"] > cast["rel_error_mean"] > 0


def test_a_cast_copy_leaves_the_trained_weights_alone_and_keeps_islands_fp32():
    cfg = make_cfg(*VISION["resnet"], "dataset.batch_size=8", *QUIET)
    data, task = build(cfg)
    fp32_islands.keep_fp32(task, ["head"], "cpu")
    before = {k: v.clone() for k, v in task.state_dict().items()}
    half = cast_copy(task, torch.float16)
    assert half.features[0].weight.dtype == torch.float16
    assert half.features[1].running_var.dtype == torch.float16  # BatchNorm's statistics too
    assert half.head.weight.dtype == torch.float32  # the island
    seen = []
    half.head.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    batch = data.collate("validation", [(1, 0, i) for i in range(8)])
    with torch.no_grad():
        logits = half.eval().logits(batch)
    assert seen == [(torch.float32, torch.float32)] and torch.isfinite(logits).all()
    after = task.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


def test_a_run_with_an_fp32_island_evaluates_its_cast_copy(tmp_path):
    summary = run(
        make_cfg(
            *TINY_MLP,
            "trainer.max_steps=4",
            "precision.fp32_modules=[net.3]",  # the second Linear
            "runner.eval_precisions=[fp16_cast]",
        ),
        tmp_path,
    )
    rows = summary["eval_precisions"]
    assert list(rows) == ["fp32", "fp16_cast"] and rows["fp16_cast"]["status"] == "ok", rows
    assert 0 < rows["fp16_cast"]["kl_mean"] < 1e-3


# -- a transformer ----------------------------------------------------------------------------


def test_a_transformer_in_every_precision_against_its_own_cast(tmp_path):
    cfg = make_cfg(
        *TINY_BERT,
        "trainer.max_steps=6",
        "trainer.val_check_interval=6",
        "trainer.limit_val_batches=2",
        EVERY,
    )
    summary = run(cfg, tmp_path)
    rows = summary["eval_precisions"]
    assert all(r["status"] == "ok" for r in rows.values()), rows
    assert all(rows[n]["kl_mean"] > 0 for n in ("bf16", "fp16", "fp16_cast", "bf16_cast"))
    assert rows["bf16"]["kl_mean"] > rows["fp16"]["kl_mean"]
    # The test's own bf16 deployment of the checkpoint: the HF model, .to(bfloat16).
    data, task = build(cfg)
    task.load_state_dict(load_last(tmp_path)["model"])
    bf16 = copy.deepcopy(task.model).eval().to(torch.bfloat16)
    kl, tokens = 0.0, 0
    with torch.no_grad():
        for batch in data.val_loader(2):
            reference = task.eval().model(input_ids=batch["input_ids"]).logits
            ours = bf16(input_ids=batch["input_ids"]).logits.float()
            kl += _kl(reference.flatten(0, 1), ours.flatten(0, 1)).item()
            tokens += batch["input_ids"].numel()
    assert rows["bf16_cast"]["kl_mean"] == pytest.approx(kl / tokens, rel=1e-3)


# -- the same noise for every precision ------------------------------------------------------


def test_a_gan_draws_the_same_noise_in_every_precision(tmp_path):
    """Its generator's images from the same noise differ by fp16's rounding; from other noise,
    by as much as two images do."""
    summary = run(
        make_cfg(
            "model=gan",
            "model.width=4",
            "dataset.image_size=16",
            "dataset.batch_size=8",
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            "trainer.limit_val_batches=2",
            "runner.eval_precisions=[fp16]",
            *QUIET,
        ),
        tmp_path,
    )
    fp16 = summary["eval_precisions"]["fp16"]
    assert fp16["status"] == "ok" and 0 < fp16["rel_error_max"] < 0.05, fp16


# -- bad input, and the comparison's table ---------------------------------------------------


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["runner.eval_precisions=[fp8]"], "allowed: fp32, bf16, fp16, fp16_cast, bf16_cast"),
        (["runner.eval_precisions=[fp16]", "trainer.limit_val_batches=0"], "limit_val_batches"),
        (["runner.eval_precisions=[fp16]", "trainer.strategy=fsdp"], "trainer.strategy=fsdp"),
    ],
)
def test_bad_eval_precisions_are_one_line(tmp_path, overrides, words):
    with pytest.raises(UserError, match="runner.eval_precisions=") as e:
        run(make_cfg(*TINY_MLP, *overrides), tmp_path)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_comparison_shows_each_rows_inference_precisions(tmp_path):
    for folder, mode in (("0", "fp32"), ("1", "bf16")):
        overrides = [f"precision={mode}", "runner.eval_precisions=[fp16,fp16_cast]"]
        cfg = make_cfg(*TINY_MLP, "trainer.max_steps=10", *overrides)
        (tmp_path / folder / ".hydra").mkdir(parents=True)
        OmegaConf.save(cfg, tmp_path / folder / ".hydra" / "config.yaml")
        OmegaConf.save(OmegaConf.create(overrides), tmp_path / folder / ".hydra" / "overrides.yaml")
        run(cfg, tmp_path / folder)
    compare(tmp_path, wandb_log=False)
    md = (tmp_path / "compare.md").read_text()
    assert "## Inference precision" in md
    summaries = {f: json.loads((tmp_path / f / "summary.json").read_text()) for f in "01"}
    for summary in summaries.values():
        cast = summary["eval_precisions"]["fp16_cast"]
        line = next(
            x for x in md.splitlines() if x.startswith(f"| {summary['precision']} | fp16_cast |")
        )
        assert f"{cast['metrics']['eval_loss']:.4g} ({cast['change']['eval_loss']:+.3g})" in line
    records = json.loads((tmp_path / "compare.json").read_text())
    assert {r["job"]: r["eval_precisions"] for r in records} == {
        f: s["eval_precisions"] for f, s in summaries.items()
    }
    printed = subprocess.run(
        [sys.executable, "-m", "runner.compare", str(tmp_path)], capture_output=True, text=True
    )
    assert "inference precision" in printed.stdout and "fp16_cast" in printed.stdout


# -- the reference is the weights in fp32, whatever mode trained them -------------------------


def _fp32_loss(cfg, weights: dict) -> float:
    """An fp32 evaluation of `weights` in a model built afresh from `cfg`: no precision mode."""
    data, task = build(cfg)
    task.load_state_dict(weights)  # fp16 or bf16 values are widened into the fp32 model
    variant = Variant(task)
    with evaluating(task):
        count = evaluation_run([variant], data.val_loader(cfg.trainer.limit_val_batches), dict)
    return variant.metrics(count)["eval_loss"]


def test_after_fp8_the_fp32_row_is_a_true_fp32_evaluation(tmp_path):
    """The trained model's converted Linears run fp8 GEMMs while the mode is on; the fp32 row is
    the same weights in plain fp32 Linears."""
    pytest.importorskip("torchao")
    cfg = make_cfg(
        *TINY_BERT,
        "precision=fp8",
        "precision.fp8.min_features=16",
        "trainer.max_steps=2",
        "trainer.val_check_interval=0",
        "trainer.limit_val_batches=2",
        "runner.eval_precisions=[bf16,bf16_cast]",
    )
    summary = run(cfg, tmp_path)
    assert summary["converted"]["converted"]  # the mode did convert Linears
    rows = summary["eval_precisions"]
    assert all(r["status"] == "ok" for r in rows.values()), rows
    truth = _fp32_loss(cfg, load_last(tmp_path)["model"])
    assert rows["fp32"]["metrics"]["eval_loss"] == pytest.approx(truth, rel=1e-6)


def test_after_bf16_true_the_norms_of_the_fp32_row_and_the_cast_copies_are_their_own_dtype():
    """bf16_true hands a norm layer's output on in bf16 (its `cast` layer); the fp32 reference
    computes it in fp32 and an fp16 cast copy in fp16. Read off the norms' forward hooks, which
    the copies take with them."""
    cfg = make_cfg(*TINY_BERT, "precision=bf16_true", "trainer.limit_val_batches=1")
    data, task = build(cfg)
    precision = Precision(cfg.precision, torch.device("cpu"))
    seen: dict[int, set] = {}
    for module in task.modules():
        if isinstance(module, nn.LayerNorm):
            module.register_forward_hook(
                lambda m, a, out: seen.setdefault(id(m), set()).add(out.dtype)
            )
    try:
        precision.prepare(task)
        evaluation = Evaluation(task, data, precision.autocast, 1, dict, False)
        rows = evaluate_precisions(evaluation, ["fp32", "fp16_cast"])["eval_precisions"]
    finally:
        precision.close()
    assert all(r["status"] == "ok" for r in rows.values()), rows
    norms = sum(isinstance(m, nn.LayerNorm) for m in task.modules())
    # each copy's norms (the trained task's own never ran): fp32's and fp16_cast's
    assert len(seen) == 2 * norms
    assert sorted(str(d) for dtypes in seen.values() for d in dtypes) == sorted(
        ["torch.float32"] * norms + ["torch.float16"] * norms
    )


def test_after_fp16_master_the_fp32_row_evaluates_the_masters(tmp_path):
    """The weights of an fp16_master run are its fp32 masters; the model holds their fp16
    copies. The fp32 row is the masters' evaluation, not the copies'."""
    cfg = make_cfg(
        *TINY_MLP,
        "precision=fp16_master",
        "trainer.max_steps=3",
        "trainer.val_check_interval=0",
        "trainer.limit_val_batches=2",
        "runner.eval_precisions=[fp16_cast]",
    )
    rows = run(cfg, tmp_path)["eval_precisions"]
    state = load_last(tmp_path)
    copies = state["model"]
    halves = [name for name, value in copies.items() if value.dtype == torch.float16]
    masters = copies | dict(zip(halves, state["master_weights"], strict=True))
    truth, of_copies = _fp32_loss(cfg, masters), _fp32_loss(cfg, copies)
    assert abs(truth - of_copies) > 1e-6 * truth  # fp16's rounding of the weights shows
    assert rows["fp32"]["metrics"]["eval_loss"] == pytest.approx(truth, rel=1e-8), of_copies
