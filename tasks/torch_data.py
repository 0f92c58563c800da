"""`dataset=torch`: the user's own datasets, built by `_target_`, fed through the runner's sample
stream (the same order for any batch size, exact resume, dealt out to ranks)."""

from __future__ import annotations

from collections.abc import Mapping

import datasets
import torch
from hydra.utils import instantiate
from torch.utils.data import default_collate

from runner.errors import UserError, building
from runner.task import Batch, DataModule


def _describe(item) -> str:
    if isinstance(item, Mapping):
        return f"a dict with keys {', '.join(map(str, item))}"
    if isinstance(item, (tuple, list)):
        return f"a {type(item).__name__} of {len(item)}"
    return f"a {type(item).__name__}"


class TorchData(DataModule):
    """`train` / `validation`: nodes with `_target_` returning a `torch.utils.data.Dataset` or a
    Hugging Face `datasets.Dataset`. Items are `(input, target)` pairs (`input` a tensor or a
    dict of tensors) or dicts of tensors with the target under `labels`; numbers and numpy
    arrays become tensors."""

    kind = "torch"

    def __init__(
        self,
        train: Mapping,
        seed: int,
        batch_size: int,
        validation: Mapping | None = None,
        num_workers: int = 0,
    ):
        if batch_size < 1:
            raise UserError(f"dataset.batch_size={batch_size} is invalid: must be ≥ 1")
        self.seed, self.batch_size, self.num_workers = seed, batch_size, num_workers
        self.splits = {"train": self._build("dataset.train", train)}
        if validation is not None and validation.get("_target_") is not None:
            self.splits["validation"] = self._build("dataset.validation", validation)
        for split, data in self.splits.items():
            if len(data) == 0:
                raise UserError(f"dataset.{split} is empty")
            self.collate(split, [(0, 0, 0)])  # the first item, so a bad one fails here

    @staticmethod
    def _build(key: str, node: Mapping):
        with building(key, node):
            data = instantiate(node)
        if isinstance(data, datasets.Dataset):
            text = [n for n, f in data.features.items() if getattr(f, "dtype", "") == "string"]
            if text:
                raise UserError(
                    f"{key}: column {text[0]!r} holds text: tokenize it first (datasets.map) or "
                    "drop it (remove_columns)"
                )
            return data.with_format("torch")
        if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
            raise UserError(
                f"{key} ({node['_target_']}) returned a {type(data).__name__}: expected a "
                "map-style torch.utils.data.Dataset or a datasets.Dataset"
            )
        return data

    def split_size(self, split: str) -> int:
        return len(self.splits[split]) if split in self.splits else 0

    def collate(self, split: str, keys: list[tuple[int, int, int]]) -> Batch:
        data, indices = self.splits[split], [k[2] for k in keys]
        if isinstance(data, datasets.Dataset):
            return dict(data[indices])
        items = [data[i] for i in indices]
        first = items[0]
        if isinstance(first, (tuple, list)) and len(first) == 2:
            inputs, target = default_collate(items)
            inputs = inputs if isinstance(inputs, Mapping) else {"input": inputs}
            batch = {**inputs, "labels": target}
        elif isinstance(first, Mapping):
            batch = default_collate(items)
        else:
            raise UserError(
                f"dataset.{split}: item {indices[0]} is {_describe(first)}: expected an (input, "
                "target) pair or a dict of tensors"
            )
        wrong = [k for k, v in batch.items() if not isinstance(v, torch.Tensor)]
        if wrong:
            raise UserError(
                f"dataset.{split}: field {wrong[0]!r} of the items is not a tensor, number or "
                "numpy array"
            )
        return batch
