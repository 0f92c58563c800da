"""Data: per-sample masking fixed by (seed, epoch, index), a batch-size-free sample order, caches,
local text files."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from runner.errors import UserError
from runner.run import build
from tasks.text import IGNORE_INDEX
from tasks.text_data import MASK_ID
from tests.helpers import TINY_BERT, TINY_BERT_MODEL, make_cfg


def _batches(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _cat(batches, key):
    return torch.cat([b[key] for b in batches])


@pytest.fixture(scope="module")
def text_data():
    data, _ = build(make_cfg(*TINY_BERT))
    return data


def test_samples_and_masks_do_not_depend_on_batch_size(text_data):
    text_data.batch_size = 4
    small = _batches(text_data.train_loader(), 8)
    text_data.batch_size = 16
    big = _batches(text_data.train_loader(), 2)
    text_data.batch_size = 8
    for key in ("input_ids", "labels"):
        assert torch.equal(_cat(small, key), _cat(big, key))


def test_a_resumed_stream_continues_exactly(text_data):
    size = text_data.split_size("train")
    start = size - 5  # resume across an epoch boundary
    full = _cat(_batches(text_data.train_loader(), (size + 20) // 8), "labels")
    resumed = _cat(_batches(text_data.train_loader(start_sample=start), 2), "labels")
    assert torch.equal(resumed, full[start : start + 16])


def test_each_epoch_reshuffles_and_remasks(text_data):
    size = text_data.split_size("train")
    stream = _cat(_batches(text_data.train_loader(), 2 * size // 8), "labels")
    assert not torch.equal(stream[:size], stream[size : 2 * size])


def test_masking_follows_the_80_10_10_rule(text_data):
    text_data.batch_size = 256
    batch = next(iter(text_data.train_loader()))
    text_data.batch_size = 8
    chosen = batch["labels"] != IGNORE_INDEX
    assert 0.13 < chosen.float().mean() < 0.17
    ids = batch["input_ids"][chosen]
    masked = (ids == MASK_ID).float().mean()
    kept = (ids == batch["labels"][chosen]).float().mean()
    assert 0.77 < masked < 0.83
    assert 0.08 < kept < 0.14  # 10% kept, plus random picks that hit the same token
    assert not (batch["input_ids"][~chosen] == MASK_ID).any()


def test_tokenizer_is_cached(text_data):
    again, _ = build(make_cfg(*TINY_BERT))
    assert again.tokenizer.to_str() == text_data.tokenizer.to_str()
    cache = os.environ["AMP_RUNNER_CACHE"]
    assert len(list((__import__("pathlib").Path(cache) / "tokenizers").glob("*.json"))) >= 1


def test_text_files_train_a_tokenizer_on_local_text(tmp_path):
    words = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex".split()
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(words, size=40)) for _ in range(60)]
    (tmp_path / "a.txt").write_text("\n".join(lines[:30]) + "\n")
    (tmp_path / "b.txt").write_text("\n\n".join(lines[30:]) + "\n")  # blank lines are skipped
    cfg = make_cfg(
        *TINY_BERT_MODEL,
        "dataset=text_files",
        f"dataset.data_files={tmp_path}/*.txt",
        "dataset.vocab_size=200",
        "dataset.seq_len=16",
    )
    data, task = build(cfg)
    assert data.split_size("train") > 0 and data.split_size("validation") > 0
    batch = next(iter(data.train_loader()))
    assert batch["input_ids"].shape == (8, 16)
    assert "quick" in data.tokenizer.get_vocab()
    assert task(batch).isfinite()


@pytest.mark.parametrize(
    "content, message",
    [(None, "no file found at"), ("", "is empty"), ("short\n", "fewer than seq_len=32 tokens")],
)
def test_unusable_text_files_are_one_clear_error(tmp_path, content, message):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_text(content)
    cfg = make_cfg(*TINY_BERT_MODEL, "dataset=text_files", f"dataset.data_files={path}")
    with pytest.raises(UserError, match=message):
        build(cfg)


def test_a_model_refuses_data_it_cannot_read():
    with pytest.raises(UserError, match="model=bert needs a text dataset"):
        build(make_cfg("model=bert", "dataset=blobs"))


@pytest.mark.parametrize("fmt", ["json", "csv", "parquet"])
def test_json_csv_and_parquet_files_load_through_the_same_path(tmp_path, fmt):
    import datasets

    words = "amber bright cobalt dusty ember frost glade harbor ivory jade".split()
    rng = np.random.default_rng(1)
    docs = [" ".join(rng.choice(words, size=30)) for _ in range(40)]
    table = datasets.Dataset.from_dict({"body": docs, "id": list(range(40))})
    path = tmp_path / f"docs.{fmt}"
    {"json": table.to_json, "csv": table.to_csv, "parquet": table.to_parquet}[fmt](str(path))
    cfg = make_cfg(
        *TINY_BERT_MODEL,
        "dataset=text_files",
        f"dataset.data_files={path}",
        f"dataset.format={fmt}",
        "dataset.text_column=body",
        "dataset.vocab_size=100",
        "dataset.seq_len=16",
    )
    data, task = build(cfg)
    assert data.split_size("train") > 0 and "cobalt" in data.tokenizer.get_vocab()
    assert task(next(iter(data.train_loader()))).isfinite()
    wrong = make_cfg(
        *TINY_BERT_MODEL,
        "dataset=text_files",
        f"dataset.data_files={path}",
        f"dataset.format={fmt}",
    )
    with pytest.raises(UserError, match="dataset.text_column='text' is not a column .*body, id"):
        build(wrong)


def test_a_hub_dataset_offline_is_one_clear_error():
    cfg = make_cfg(*TINY_BERT_MODEL, "dataset=hub_text", "dataset.path=no-such-user/no-such-set")
    with pytest.raises(UserError, match=r"dataset.path: cannot load 'no-such-user/no-such-set': "):
        build(cfg)


def test_an_image_folder_trains_a_resnet(tmp_path):
    from PIL import Image

    from runner.run import run

    rng = np.random.default_rng(2)
    for label, level in (("dark", 40), ("light", 210)):
        (tmp_path / "images" / label).mkdir(parents=True)
        for i in range(8):
            pixels = np.clip(rng.normal(level, 20, (20, 24, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(tmp_path / "images" / label / f"{i}.png")
    cfg = make_cfg(
        "model=resnet",
        "model.width=4",
        "dataset=image_folder",
        f"dataset.data_dir={tmp_path / 'images'}",
        "dataset.image_size=16",
        "dataset.batch_size=4",
        "dataset.validation_fraction=0.25",
        "logger=none",
        "trainer.progress_bar=false",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
    )
    data, _ = build(cfg)
    assert data.num_classes == 2 and data.split_size("train") == 12
    batch = next(iter(data.train_loader()))
    assert batch["image"].shape == (4, 3, 16, 16) and batch["image"].abs().max() <= 1
    assert run(cfg, tmp_path / "run")["status"] == "completed"
    with pytest.raises(UserError, match="cannot load images"):
        build(make_cfg("model=resnet", "dataset=image_folder", f"dataset.data_dir={tmp_path}/none"))
