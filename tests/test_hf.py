"""`model=hf`: Hugging Face models from a local `save_pretrained` directory (tiny ones, made here:
tests never download), fine-tuned or built from their config, on text and images."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import datasets
import pytest
import torch
import transformers

from runner.errors import UserError
from runner.run import build, run
from tests.helpers import load_last, make_cfg, read_metrics
from tests.test_own_model import QUIET, assert_recomputed_alike

POSITIVE = ["good", "great", "fine", "nice"]
NEGATIVE = ["bad", "poor", "awful", "sad"]
NEUTRAL = ["the", "a", "film", "was", "it", "plot", "and", "cast", "very", "quite", "so", "end"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TINY = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)


def _tokenizer(folder) -> transformers.PreTrainedTokenizerFast:
    words = SPECIAL + POSITIVE + NEGATIVE + NEUTRAL
    tokenizer = transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(words)})
    tokenizer.save_pretrained(folder)
    return tokenizer


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A tiny BERT classifier and its tokenizer, saved in bf16 (weights must load in fp32)."""
    folder = tmp_path_factory.mktemp("bert")
    tokenizer = _tokenizer(folder)
    config = transformers.BertConfig(vocab_size=len(tokenizer), num_labels=2, **TINY)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reviews(tmp_path_factory):
    """Sentences of neutral words and one sentiment word; 60% negative (the majority class)."""
    folder = tmp_path_factory.mktemp("reviews")
    rng = random.Random(0)
    for name, n in (("train", 400), ("validation", 100)):
        with open(folder / f"{name}.csv", "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["review", "sentiment"])
            for _ in range(n):
                label = "pos" if rng.random() < 0.4 else "neg"
                words = rng.choices(NEUTRAL, k=6)
                words.insert(rng.randrange(7), rng.choice(POSITIVE if label == "pos" else NEGATIVE))
                out.writerow([" ".join(words), label])
    return folder


def hf(folder, *overrides: str):
    return make_cfg("model=hf", f"model.name_or_path={folder}", *QUIET, *overrides)


def short_causal_lm(folder, text: Path, *overrides: str):
    """`model=hf` at `folder` as a causal LM on `text`: two steps of 4 sequences of 16 tokens,
    no evaluation."""
    return hf(
        folder,
        *causal_lm_on_text(text),
        "dataset.seq_len=16",
        "dataset.batch_size=4",
        "trainer.max_steps=2",
        "trainer.val_check_interval=0",
        *overrides,
    )


def causal_lm_on_text(text: Path, *overrides: str) -> list[str]:
    """`model=hf` as a causal LM with its own loss, on the local text file `text`."""
    return [
        "model.task=causal_lm",
        "model.loss=output",
        "dataset=text_files",
        f"dataset.data_files={text}",
        *overrides,
    ]


def classify(bert_dir, reviews, *overrides: str):
    return hf(
        bert_dir,
        f"dataset.data_files={reviews / 'train.csv'}",
        f"dataset.validation_files={reviews / 'validation.csv'}",
        "dataset.text_column=review",
        "dataset.label_column=sentiment",
        "dataset.batch_size=16",
        *overrides,
    )


def test_a_saved_classifier_fine_tunes_past_the_majority_class(tmp_path, bert_dir, reviews):
    steps = [
        "trainer.max_steps=40",
        "trainer.val_check_interval=40",
        "optim.optimizer.lr=1e-2",
        "optim.scheduler.warmup_steps=5",
    ]
    summary = run(classify(bert_dir, reviews, *steps), tmp_path / "tuned")
    assert summary["status"] == "completed" and summary["pretrained"] is True
    assert summary["weights_saved_dtype"] == "bfloat16"
    assert all(t.dtype == torch.float32 for t in load_last(tmp_path / "tuned")["model"].values())
    assert summary["eval_accuracy"] > 0.6 + 0.1, summary["eval_accuracy"]  # majority: 0.6
    assert 0 < summary["eval_macro_f1"] <= 1
    scratch = run(
        classify(bert_dir, reviews, "model.pretrained=false", "trainer.max_steps=1"),
        tmp_path / "scratch",
    )
    assert scratch["weights_saved_dtype"] is None
    first = [read_metrics(tmp_path / d)[0]["loss"] for d in ("tuned", "scratch")]
    assert first[0] != first[1]  # random weights, not the saved ones


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_hf_gradient_checkpointing_recomputes_in_the_forwards_precision(
    bert_dir, reviews, precision
):
    data, plain = build(classify(bert_dir, reviews, "dataset.batch_size=4"))
    _, checkpointed = build(
        classify(bert_dir, reviews, "dataset.batch_size=4", "model.gradient_checkpointing=true")
    )
    plain.train(), checkpointed.train()
    batch = data.collate("train", [(0, 0, i) for i in range(4)])
    assert_recomputed_alike(plain, checkpointed, batch, precision)


def tiny_gpt2_and_text(tmp_path, documents: int, layers: int = 1) -> tuple:
    """A transformers GPT-2 of `layers` blocks saved with `save_pretrained` (with its tokenizer)
    and a local text file of `documents` lines: the folder and the file."""
    folder = tmp_path / "gpt"
    config = transformers.GPT2Config(
        vocab_size=len(_tokenizer(folder)), n_embd=32, n_layer=layers, n_head=2, n_positions=64
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    rng = random.Random(1)
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(" ".join(rng.choices(NEUTRAL[:6], k=30)) for _ in range(documents)))
    return folder, text


def test_a_causal_lm_trains_on_its_own_loss(tmp_path):
    """`model.loss=output`: the model's own (shifted, mean) loss, through model=hf, on local text
    tokenized with the model's tokenizer."""
    folder, text = tiny_gpt2_and_text(tmp_path, documents=200)
    cfg = hf(
        folder,
        *causal_lm_on_text(text),
        "dataset.seq_len=32",
        "dataset.batch_size=8",
        "trainer.max_steps=12",
        "optim.optimizer.lr=3e-3",
    )
    summary = run(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert summary["status"] == "completed" and summary["hf_task"] == "causal_lm"
    assert rows[-1]["loss"] < rows[0]["loss"]


def token_table(n: int = 64) -> datasets.Dataset:
    """Token classification data as a user brings it: ids, mask and one label per token (is the
    word positive?), -100 on [CLS] and [SEP]."""
    rng = random.Random(2)
    words = SPECIAL + POSITIVE + NEGATIVE + NEUTRAL
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        ids = [rng.randrange(len(SPECIAL), len(words)) for _ in range(8)]
        rows["input_ids"].append([2, *ids, 3])
        rows["attention_mask"].append([1] * 10)
        rows["labels"].append([-100, *(int(words[i] in POSITIVE) for i in ids), -100])
    return datasets.Dataset.from_dict(rows)


def test_token_classification_on_a_users_dataset(tmp_path, bert_dir):
    """Per-token labels: normalised by the labelled tokens, not by the sequences."""
    cfg = hf(
        bert_dir,
        "model.task=token_classification",
        "dataset=torch",
        "dataset.train._target_=tests.test_hf.token_table",
        "dataset.batch_size=8",
        "trainer.max_steps=3",
    )
    data, task = build(cfg)
    batch = data.collate("train", [(0, 0, i) for i in range(8)])
    assert task.num_targets(batch) == 8 * 8
    assert run(cfg, tmp_path)["status"] == "completed"


def _save_vision(folder, kind: str) -> None:
    if kind == "resnet":
        config = transformers.ResNetConfig(
            num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4
        )
    else:
        config = transformers.ViTConfig(
            image_size=16, patch_size=4, num_channels=3, num_labels=4, **TINY
        )
    transformers.AutoModelForImageClassification.from_config(config).save_pretrained(folder)


@pytest.mark.parametrize("kind", ["resnet", "vit"])
def test_vision_models_train_in_every_precision(tmp_path, kind):
    folder = tmp_path / kind
    _save_vision(folder, kind)
    for precision in ("fp32", "bf16", "fp16"):
        cfg = hf(
            folder,
            "model.task=image_classification",
            "dataset=synthetic_images",
            "dataset.image_size=16",
            "dataset.num_samples=64",
            "dataset.batch_size=8",
            "trainer.max_steps=3",
            f"precision={precision}",
            # a scale that fits a tiny ViT's gradients: 65536 overflowed its first fp16 step
            "precision.grad_scaler.init_scale=1024",
        )
        summary = run(cfg, tmp_path / precision)
        assert summary["status"] == "completed" and summary["skipped_steps"] == 0
    if kind == "resnet":  # convolutional: channels_last by default
        weights = load_last(tmp_path / "fp32")["model"]
        conv = next(v for k, v in weights.items() if v.ndim == 4)
        assert conv.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.name_or_path=bert-base-uncased"],
            "'bert-base-uncased' cannot be loaded: We couldn't",
        ),
        (["model.task=summarisation"], "model.task='summarisation' is invalid: allowed:"),
        (["dataset.label_column=stars"], "stars"),
        (["model.task=image_classification"], "model.task=image_classification reads images data"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, bert_dir, reviews, overrides, message):
    with pytest.raises(UserError) as error:
        run(classify(bert_dir, reviews, *overrides), tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_task_the_model_does_not_support_is_one_clear_line(tmp_path):
    _tokenizer(tmp_path / "vit")
    _save_vision(tmp_path / "vit", "vit")
    cfg = hf(tmp_path / "vit", "model.task=masked_lm", "dataset=synthetic_text")
    with pytest.raises(UserError, match="model.task=masked_lm is not supported by vit models"):
        run(cfg, tmp_path / "run")
