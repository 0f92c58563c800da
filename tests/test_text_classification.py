"""Pretrained tokenizers: `dataset=text_classification` (labels, sentence pairs, padding, clear
errors) and text corpora tokenized by a pretrained tokenizer instead of a trained WordPiece."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from hydra.utils import instantiate

from runner.errors import UserError, building
from tasks.text import IGNORE_INDEX
from tasks.text_data import SEP_ID
from tests.helpers import make_cfg

# Specials last, so their ids differ from the trained WordPiece's fixed PAD/SEP/MASK ids.
WORDS = "the a cat dog sat ran on mat rug good bad film plot".split()
SPECIALS = ["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A tiny BERT tokenizer saved as a folder, as `dataset.tokenizer` would name one."""
    from transformers import AutoTokenizer, BertTokenizerFast

    root = tmp_path_factory.mktemp("tokenizer")
    (root / "vocab").mkdir()
    (root / "vocab" / "vocab.txt").write_text("\n".join([*WORDS, *SPECIALS]) + "\n")
    BertTokenizerFast.from_pretrained(str(root / "vocab")).save_pretrained(str(root / "tok"))
    hf = AutoTokenizer.from_pretrained(str(root / "tok"))
    assert hf.sep_token_id == len(WORDS) + 3  # the vocabulary was read, not a default one
    return str(root / "tok"), hf


@pytest.fixture(scope="module")
def eos_tok(tmp_path_factory):
    """A GPT-like word-level tokenizer: an eos token, no sep, mask or pad token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate([*WORDS, "[UNK]", "<eos>"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<eos>")
    folder = tmp_path_factory.mktemp("eos-tokenizer")
    hf.save_pretrained(str(folder))
    return str(folder), vocab


def _write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    return str(path)


def _build(cfg):
    """The dataset as a run builds it: its own UserError comes out as it is, not wrapped."""
    with building("dataset", cfg.dataset):
        return instantiate(cfg.dataset)


def _data(tok_dir, *overrides):
    return _build(
        make_cfg("dataset=text_classification", f"dataset.tokenizer={tok_dir}", *overrides)
    )


def _batch(data, split, indices):
    return data.collate(split, [(0, 0, i) for i in indices])


def test_string_labels_map_to_sorted_ids_and_empty_texts_are_dropped(tmp_path, tok):
    rows = [["the film good", "pos"], ["bad plot", "neg"], ["", "pos"], ["a good cat", "pos"]]
    path = _write_csv(tmp_path / "train.csv", ["text", "label"], rows * 5)
    data = _data(tok[0], f"dataset.data_files={path}", "dataset.validation_fraction=0")
    assert data.label_names == ["neg", "pos"] and data.num_classes == 2
    assert data.split_size("train") == 15 and data.split_size("validation") == 0
    batch = _batch(data, "train", [0, 1, 2])
    assert batch["labels"].tolist() == [1, 0, 1] and batch["labels"].dtype == torch.int64
    assert data.describe()["num_classes"] == 2


def test_validation_labels_unseen_in_training_are_one_clear_error(tmp_path, tok):
    train = _write_csv(tmp_path / "train.csv", ["text", "label"], [["good", "pos"]] * 4)
    val = _write_csv(tmp_path / "val.csv", ["text", "label"], [["bad", "meh"]])
    with pytest.raises(UserError, match="the validation split has labels .* lacks: 'meh'"):
        _data(tok[0], f"dataset.data_files={train}", f"dataset.validation_files={val}")


def test_integer_and_class_label_columns_keep_their_ids(tmp_path, tok):
    import datasets

    rows = [{"review": "good film", "stars": 4}, {"review": "bad film", "stars": 1}] * 4
    path = tmp_path / "train.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = _data(
        tok[0],
        f"dataset.data_files={path}",
        "dataset.format=json",
        "dataset.text_column=review",
        "dataset.label_column=stars",
        "dataset.validation_fraction=0",
    )
    assert data.num_classes == 5 and data.label_names == ["0", "1", "2", "3", "4"]
    assert _batch(data, "train", range(8))["labels"].tolist() == [4, 1] * 4

    feature = datasets.ClassLabel(names=["negative", "neutral", "positive"])
    table = datasets.Dataset.from_dict(
        {"text": ["good", "bad", "the mat"] * 4, "label": [2, 0, 1] * 4},
        features=datasets.Features({"text": datasets.Value("string"), "label": feature}),
    )
    table.to_parquet(str(tmp_path / "train.parquet"))
    data = _data(
        tok[0],
        f"dataset.data_files={tmp_path}/train.parquet",
        "dataset.format=parquet",
        "dataset.validation_fraction=0",
    )
    assert data.label_names == ["negative", "neutral", "positive"] and data.num_classes == 3
    assert _batch(data, "train", range(12))["labels"].tolist() == [2, 0, 1] * 4


def test_sentence_pairs_carry_both_texts_and_segment_ids(tmp_path, tok, eos_tok):
    tok_dir, hf = tok
    rows = [["the cat sat", "on the mat", "yes"], ["a dog ran", "the film", "no"]] * 3
    path = _write_csv(tmp_path / "pairs.csv", ["premise", "hypothesis", "label"], rows)
    data = _data(
        tok_dir,
        f"dataset.data_files={path}",
        "dataset.text_column=[premise,hypothesis]",
        "dataset.validation_fraction=0",
    )
    batch = _batch(data, "train", [0])
    expected = hf("the cat sat", "on the mat")
    assert batch["input_ids"][0].tolist() == expected["input_ids"]
    assert batch["token_type_ids"][0].tolist() == expected["token_type_ids"]
    assert batch["token_type_ids"][0].tolist() == [0] * 5 + [1] * 4  # [CLS] 3 [SEP] | 3 [SEP]
    assert (batch["input_ids"][0] == hf.sep_token_id).sum() == 2
    # Another tokenizer on the same file is not served the first one's cached ids.
    other = _data(
        eos_tok[0],
        f"dataset.data_files={path}",
        "dataset.text_column=[premise,hypothesis]",
        "dataset.validation_fraction=0",
    )
    assert _batch(other, "train", [0])["input_ids"][0].tolist() == [0, 2, 4, 6, 0, 7]  # no specials
    assert "token_type_ids" not in _batch(other, "train", [0])


def test_collate_pads_to_the_longest_text_of_the_batch_and_truncates_to_seq_len(tmp_path, tok):
    tok_dir, hf = tok
    rows = [["the cat", "a"], ["the cat sat on the mat a dog ran on", "b"], ["dog", "a"]]
    path = _write_csv(tmp_path / "train.csv", ["text", "label"], rows)
    data = _data(tok_dir, f"dataset.data_files={path}", "dataset.validation_fraction=0")
    batch = _batch(data, "train", [0, 1, 2])
    lengths = [4, 12, 3]  # [CLS] words [SEP]
    assert batch["input_ids"].shape == (3, 12)
    assert batch["attention_mask"].sum(1).tolist() == lengths
    for row, n in enumerate(lengths):
        assert (batch["input_ids"][row, n:] == hf.pad_token_id).all()
        assert (batch["input_ids"][row, :n] != hf.pad_token_id).all()
    assert {v.dtype for v in batch.values()} == {torch.int64}
    assert _batch(data, "train", [0, 2])["input_ids"].shape == (2, 4)
    short = _data(tok_dir, f"dataset.data_files={path}", "dataset.seq_len=8")
    long_text = _batch(short, "train", range(short.split_size("train")))["input_ids"]
    assert long_text.shape[1] == 8 and hf.sep_token_id in long_text[:, -1]


@pytest.mark.parametrize(
    "override, message",
    [
        ("dataset.label_column=sentiment", r"dataset.label_column='sentiment' is not a column"),
        ("dataset.text_column=body", r"dataset.text_column='body' is not a column"),
    ],
)
def test_a_missing_column_is_one_line_naming_the_key(tmp_path, tok, override, message):
    path = _write_csv(tmp_path / "train.csv", ["text", "label"], [["good", "pos"]] * 3)
    with pytest.raises(UserError, match=message + r" .*\(columns: text, label\)") as error:
        _data(tok[0], f"dataset.data_files={path}", override)
    assert "\n" not in str(error.value)


def test_no_tokenizer_and_an_ambiguous_source_are_clear_errors(tmp_path):
    path = _write_csv(tmp_path / "train.csv", ["text", "label"], [["good", "pos"]] * 3)
    with pytest.raises(UserError, match="needs a tokenizer: use it with model=hf"):
        _build(make_cfg("dataset=text_classification", f"dataset.data_files={path}"))
    cfg = make_cfg(
        "dataset=text_classification",
        f"dataset.tokenizer={tmp_path}",
        f"dataset.data_files={path}",
        "dataset.path=glue",
    )
    with pytest.raises(UserError, match="dataset.path and dataset.data_files: set exactly one"):
        _build(cfg)


@pytest.mark.parametrize(
    "kind, cause",
    [("missing folder", "no such directory"), ("empty folder", r"\S"), ("hub id offline", r"\S")],
)
def test_a_tokenizer_that_cannot_be_loaded_is_one_clear_error(tmp_path, kind, cause):
    name = "no-such-user/no-such-tokenizer" if kind == "hub id offline" else str(tmp_path / "tok")
    if kind == "empty folder":
        (tmp_path / "tok").mkdir()
    (tmp_path / "x.txt").write_text("the cat sat on the mat\n" * 20)
    cfg = make_cfg(
        "dataset=text_files", f"dataset.data_files={tmp_path}/x.txt", f"dataset.tokenizer={name}"
    )
    with pytest.raises(
        UserError, match=rf"^dataset.tokenizer='{name}' cannot be loaded: {cause}"
    ) as e:
        _build(cfg)
    assert "\n" not in str(e.value) and not str(e.value).endswith(":")  # the cause, not a stub


def test_a_corpus_uses_the_pretrained_tokenizers_ids(tmp_path, tok):
    tok_dir, hf = tok
    docs = ["the cat sat on the mat", "a dog ran on the rug", "good film bad plot"] * 20
    (tmp_path / "docs.txt").write_text("\n".join(docs) + "\n")
    cfg_args = [
        "dataset=text_files",
        f"dataset.data_files={tmp_path}/docs.txt",
        f"dataset.tokenizer={tok_dir}",
        "dataset.seq_len=16",
        "dataset.validation_fraction=0",
        "dataset.batch_size=64",
    ]
    cfg = make_cfg(*cfg_args)
    # The trained WordPiece first, on the same file: the blocks' cache must tell the two apart.
    assert _build(make_cfg(*(o for o in cfg_args if "tokenizer" not in o))).sep_id == SEP_ID
    data = _build(cfg)
    assert (data.sep_id, data.mask_id, data.pad_id) == (
        hf.sep_token_id,
        hf.mask_token_id,
        hf.pad_token_id,
    )
    assert data.vocab_size == len(hf)
    encoded = hf(docs, add_special_tokens=False)["input_ids"]
    stream = [i for ids in encoded for i in [*ids, hf.sep_token_id]]
    data.use_objective("causal")
    blocks = data.collate("train", [(0, 0, i) for i in range(data.split_size("train"))])
    assert blocks["input_ids"].flatten().tolist() == stream[: blocks["input_ids"].numel()]
    assert hf.unk_token_id not in blocks["input_ids"]

    data.use_objective("mlm")
    batch = next(iter(data.train_loader()))
    chosen = batch["labels"] != IGNORE_INDEX
    masked = batch["input_ids"][chosen]
    assert (masked == hf.mask_token_id).float().mean() > 0.6
    assert not (batch["input_ids"][~chosen] == hf.mask_token_id).any()
    replaced = masked[(masked != hf.mask_token_id) & (masked != batch["labels"][chosen])]
    assert not set(replaced.tolist()) & set(hf.all_special_ids)


def test_a_tokenizer_without_mask_token_serves_causal_models_only(tmp_path, eos_tok):
    tok_dir, vocab = eos_tok
    (tmp_path / "docs.txt").write_text("the cat sat on the mat\n" * 30)
    cfg = make_cfg(
        "dataset=text_files",
        f"dataset.data_files={tmp_path}/docs.txt",
        f"dataset.tokenizer={tok_dir}",
        "dataset.seq_len=8",
    )
    data = _build(cfg)
    assert (data.sep_id, data.mask_id, data.pad_id) == (vocab["<eos>"], None, None)
    with pytest.raises(UserError, match="has no mask token, so it cannot serve masked-language"):
        data.collate("train", [(0, 0, 0)])
    with pytest.raises(UserError, match="has no mask token"):
        data.use_objective("mlm")
    data.use_objective("causal")
    batch = data.collate("train", [(0, 0, 0)])
    assert torch.equal(batch["input_ids"], batch["labels"])
    assert vocab["<eos>"] in batch["input_ids"] and vocab["[UNK]"] not in batch["input_ids"]
