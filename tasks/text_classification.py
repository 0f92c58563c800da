"""Text classification (sentences or sentence pairs) with a pretrained tokenizer: a Hub dataset
(`dataset.path`, e.g. glue/sst2) or local csv, json or parquet files, through the same loading
path as `tasks/text_data.py`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import datasets
import numpy as np
import torch

from runner.errors import UserError
from runner.task import Batch, DataModule
from tasks.text_data import (
    _digest,
    _expand,
    load_pretrained_tokenizer,
    load_splits,
    require_column,
    tokenizer_identity,
)


def _load(
    path: str | None,
    name: str | None,
    data_files: str | Sequence[str] | None,
    validation_files: str | Sequence[str] | None,
    format: str,
    splits: dict[str, str],
    texts: list[str],
    label_column: str,
) -> datasets.DatasetDict:
    """The text and label columns of a Hub dataset or of local files, through `load_splits`;
    a missing column is one line naming its key and the columns there are."""
    if path is not None:
        key, source, load = "dataset.path", path, {"path": path, "name": name}
    else:
        files = {"train": _expand("dataset.data_files", data_files)}
        if validation_files:
            files["validation"] = _expand("dataset.validation_files", validation_files)
        key, source = "dataset.data_files", str(data_files)
        load = {"path": format, "data_files": files}
    raw = load_splits(key, load, splits)
    for split in raw.values():
        for column in texts:
            require_column("dataset.text_column", column, split, source)
        require_column("dataset.label_column", label_column, split, source)
    return raw.select_columns([*texts, label_column])


class TextClassification(DataModule):
    """Tokenized texts (truncated to `seq_len`, unpadded until `collate`) and integer labels.

    Labels: a ClassLabel feature gives its ids and names; integers are used as they are; strings
    map to ids in the sorted order of the training split's names. `num_classes`, `label_names`,
    `tokenizer` (the Hugging Face tokenizer), `pad_id` and `vocab_size` are set for models.
    Rows without a text or a label are dropped."""

    kind = "text_classification"

    def __init__(
        self,
        tokenizer: str | None,
        *,
        path: str | None = None,
        name: str | None = None,
        data_files: str | Sequence[str] | None = None,
        validation_files: str | Sequence[str] | None = None,
        format: str = "csv",
        train_split: str = "train",
        validation_split: str = "validation",
        text_column: str | Sequence[str] = "text",
        label_column: str = "label",
        seq_len: int = 128,
        batch_size: int = 16,
        validation_fraction: float = 0.1,
        seed: int = 0,
        num_workers: int = 0,
    ):
        if tokenizer is None:
            raise UserError(
                "dataset=text_classification needs a tokenizer: use it with model=hf "
                "(which sets it), or set dataset.tokenizer=PATH_OR_HUB_ID"
            )
        if (path is None) == (data_files is None):
            raise UserError(
                "dataset.path and dataset.data_files: set exactly one "
                "(a Hub dataset, or local files)"
            )
        if format not in ("csv", "json", "parquet"):
            raise UserError(f"dataset.format={format!r} is invalid: allowed: csv, json, parquet")
        if seq_len < 8:
            raise UserError(f"dataset.seq_len={seq_len} is invalid: must be ≥ 8")
        if batch_size < 1:
            raise UserError(f"dataset.batch_size={batch_size} is invalid: must be ≥ 1")
        if not 0 <= validation_fraction < 1:
            raise UserError(
                f"dataset.validation_fraction={validation_fraction} is invalid: must be in [0, 1)"
            )
        texts = [text_column] if isinstance(text_column, str) else list(text_column)
        if len(texts) not in (1, 2):
            raise UserError(
                f"dataset.text_column={texts} is invalid: one column, or a pair for sentence pairs"
            )
        self.seed, self.batch_size, self.seq_len = seed, batch_size, seq_len
        self.num_workers, self.text_columns = num_workers, texts

        self.tokenizer = load_pretrained_tokenizer(tokenizer)
        tok_id = tokenizer_identity(self.tokenizer)  # before any encoding changes the backend
        self.vocab_size = len(self.tokenizer)
        pad = self.tokenizer.pad_token_id
        # Padding is masked out, so a tokenizer without a pad token (GPT-2) pads with eos.
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)

        splits = {"train": train_split, "validation": validation_split}
        raw = _load(path, name, data_files, validation_files, format, splits, texts, label_column)
        raw = raw.filter(
            lambda row: (
                row[label_column] is not None
                and all(isinstance(row[c], str) and row[c].strip() for c in texts)
            )
        )
        if len(raw["train"]) == 0:
            raise UserError("dataset: no training row has both a text and a label")

        to_id = self._label_ids(raw, label_column)
        if "validation" not in raw and validation_fraction > 0 and len(raw["train"]) > 1:
            raw = raw["train"].train_test_split(test_size=validation_fraction, seed=seed)
            raw["validation"] = raw.pop("test")
        hf, fingerprint = self.tokenizer, (tok_id, seq_len, texts, label_column, self.label_names)

        def encode(rows: dict) -> dict:
            enc = hf(*(rows[c] for c in texts), truncation=True, max_length=seq_len)
            out = {k: enc[k] for k in ("input_ids", "token_type_ids") if k in enc}
            return out | {"labels": [to_id(label) for label in rows[label_column]]}

        self.splits = {
            name: split.map(
                encode,
                batched=True,
                remove_columns=split.column_names,
                new_fingerprint=_digest(split._fingerprint, *fingerprint),
            )
            for name, split in raw.items()
        }

    def _label_ids(self, raw: datasets.DatasetDict, column: str) -> Callable[[Any], int]:
        """Sets `label_names` and `num_classes`; returns the map from a stored label to its id."""
        feature = raw["train"].features[column]
        dtype = getattr(feature, "dtype", type(feature).__name__)
        if dtype in ("string", "large_string"):
            names = sorted(set(raw["train"][column]))
            ids = {name: i for i, name in enumerate(names)}
            for split_name, split in raw.items():
                unseen = sorted(set(split[column]) - ids.keys())
                if unseen:
                    raise UserError(
                        f"dataset.label_column={column!r}: the {split_name} split has labels "
                        f"the training split lacks: {', '.join(map(repr, unseen[:5]))}"
                    )
            self.label_names, self.num_classes = names, len(names)
            return ids.__getitem__
        if not dtype.startswith("int"):
            raise UserError(
                f"dataset.label_column={column!r} holds {dtype} values: "
                "labels must be integers, strings or a ClassLabel"
            )
        labels = np.concatenate([split.with_format("numpy")[column] for split in raw.values()])
        if labels.min() < 0:  # e.g. -1, "no label", in a ClassLabel column
            raise UserError(
                f"dataset.label_column={column!r} holds the label {labels.min()}: must be ≥ 0"
            )
        if isinstance(feature, datasets.ClassLabel):
            self.label_names = list(feature.names)
        else:
            self.label_names = [str(i) for i in range(labels.max() + 1)]
        self.num_classes = len(self.label_names)
        return int

    def split_size(self, split: str) -> int:
        return len(self.splits[split]) if split in self.splits else 0

    def collate(self, split: str, keys: list[tuple[int, int, int]]) -> Batch:
        """Pads to the batch's longest sequence: the batch's shape follows its own texts."""
        rows = self.splits[split][[k[2] for k in keys]]
        lengths = [len(ids) for ids in rows["input_ids"]]
        shape = (len(lengths), max(lengths))
        padding = {"input_ids": self.pad_id, "token_type_ids": 0}
        batch = {k: np.full(shape, pad, dtype=np.int64) for k, pad in padding.items() if k in rows}
        mask = np.zeros(shape, dtype=np.int64)
        for i, n in enumerate(lengths):
            for k, padded in batch.items():
                padded[i, :n] = rows[k][i]
            mask[i, :n] = 1
        batch["attention_mask"] = mask
        batch["labels"] = np.asarray(rows["labels"], dtype=np.int64)
        return {k: torch.from_numpy(v) for k, v in batch.items()}

    def describe(self) -> dict:
        return super().describe() | {"num_classes": self.num_classes, "seq_len": self.seq_len}
