"""The model zoo: each family trains end to end in every precision and reports its eval metric."""

from __future__ import annotations

import math

import pytest
import torch

from runner.errors import UserError
from runner.run import build, run
from tests.helpers import load_last, make_cfg, unigram_entropy

QUICK = [
    "logger=none",
    "trainer.progress_bar=false",
    "trainer.max_steps=4",
    "trainer.val_check_interval=4",
    "trainer.limit_val_batches=2",
]
TINY = {
    "gpt": [
        "model=gpt",
        "model.n_embd=32",
        "model.n_layer=1",
        "dataset.num_documents=200",
        "dataset.seq_len=32",
        "dataset.batch_size=8",
        "dataset.vocab_size=512",
    ],
    "resnet": [
        "model=resnet",
        "model.width=8",
        "dataset.num_samples=256",
        "dataset.image_size=16",
        "dataset.batch_size=8",
    ],
    "unet": [
        "model=unet",
        "model.width=4",
        "dataset.num_samples=64",
        "dataset.image_size=16",
        "dataset.batch_size=4",
    ],
    "gan": [
        "model=gan",
        "model.width=4",
        "model.latent_dim=8",
        "dataset.num_samples=64",
        "dataset.image_size=16",
        "dataset.batch_size=4",
    ],
}
METRIC = {
    "gpt": "eval_perplexity",
    "resnet": "eval_accuracy",
    "unet": "eval_dice",
    "gan": "eval_discriminator_accuracy",
}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("model", ["gpt", "resnet", "unet", "gan"])
def test_every_model_trains_in_every_precision(tmp_path, model, precision):
    summary = run(make_cfg(*TINY[model], *QUICK, f"precision={precision}"), tmp_path)
    assert summary["status"] == "completed" and summary["skipped_steps"] == 0
    assert math.isfinite(summary["final_loss"]) and math.isfinite(summary[METRIC[model]])
    if model != "gpt":
        assert 0 <= summary[METRIC[model]] <= 1


@pytest.mark.slow  # over 10 s on 2 cores: make test stays under 10 minutes
def test_gpt_learns_the_generated_language(tmp_path):
    """The causal model learns: fp32, since learning is what is tested (bf16 and fp16 train every
    model above, and are emulated, and slow, on many CPUs)."""
    cfg = make_cfg(
        *TINY["gpt"],
        *QUICK,
        "model.n_embd=64",
        "model.dropout=0",
        "precision=fp32",
        "trainer.max_steps=150",
        "trainer.val_check_interval=150",
        "optim.optimizer.lr=3e-3",
    )
    summary = run(cfg, tmp_path)
    data, _ = build(cfg)
    assert summary["eval_loss"] < 0.75 * unigram_entropy(data)
    assert summary["eval_perplexity"] == pytest.approx(math.exp(summary["eval_loss"]))


def test_batchnorm_statistics_stay_fp32_under_autocast(tmp_path):
    run(make_cfg(*TINY["resnet"], *QUICK, "precision=bf16"), tmp_path)
    state = load_last(tmp_path)["model"]
    stats = {k: v for k, v in state.items() if k.endswith(("running_mean", "running_var"))}
    assert stats and all(v.dtype == torch.float32 for v in stats.values())
    assert any(
        k.endswith("running_mean") and v.abs().sum() > 0 for k, v in stats.items()
    )  # updated


@pytest.mark.parametrize("model", ["resnet", "unet"])
def test_channels_last(tmp_path, model):
    cfg = make_cfg(*TINY[model], *QUICK, "model.channels_last=true", "precision=bf16")
    _, task = build(cfg)
    conv = next(m for m in task.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert run(cfg, tmp_path)["status"] == "completed"


def test_a_causal_model_reads_unmasked_text():
    data, task = build(make_cfg(*TINY["gpt"], *QUICK))
    batch = next(iter(data.train_loader()))
    assert torch.equal(batch["input_ids"], batch["labels"])
    assert task.num_targets(batch) == 8 * 31


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model=resnet", "dataset=synthetic_text"], "model=resnet needs a images dataset"),
        (["model=unet", "dataset=synthetic_images"], "model=unet needs a segmentation dataset"),
        (["model=gpt", "dataset=blobs"], "model=gpt needs a text dataset"),
        (
            ["model=unet", "model.depth=5", "dataset.image_size=16", "dataset.num_samples=8"],
            "must be a multiple of 32",
        ),
    ],
)
def test_incompatible_model_and_data_is_one_clear_error(overrides, message):
    with pytest.raises(UserError, match=message):
        build(make_cfg(*overrides))


def test_realistic_sizes_compose():
    gpt2 = make_cfg("model=gpt2").model
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head) == (768, 12, 12)
    unet = make_cfg("model=unet_512")
    assert unet.dataset.image_size == 512 and unet.model.depth == 4
    assert unet.dataset._target_.endswith("SyntheticShapes")
