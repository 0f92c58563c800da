"""Classification: a small MLP on generated Gaussian clusters (the fastest task, for tests)."""

from __future__ import annotations

from typing import Literal

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import UserError
from runner.task import Batch, DataModule, Task, require_kind
from tasks.ops import Fp32Softplus


class Blobs(DataModule):
    """`num_classes` Gaussian clusters in `num_features` dimensions, overlapping enough that the
    task is not solved in a handful of steps."""

    kind = "vectors"

    def __init__(
        self,
        seed: int,
        num_samples: int,
        num_features: int,
        num_classes: int,
        batch_size: int,
        validation_fraction: float,
        num_workers: int = 0,
    ):
        if batch_size < 1:
            raise UserError(f"dataset.batch_size={batch_size} is invalid: must be ≥ 1")
        self.seed, self.batch_size, self.num_workers = seed, batch_size, num_workers
        self.num_features, self.num_classes = num_features, num_classes
        rng = np.random.default_rng([seed, 11])
        centers = rng.normal(0.0, 1.0, (num_classes, num_features))
        labels = rng.integers(0, num_classes, num_samples)
        features = centers[labels] + rng.normal(0.0, 1.5, (num_samples, num_features))
        table = datasets.Dataset.from_dict(
            {"features": features.astype(np.float32), "label": labels.astype(np.int64)}
        )
        n_val = int(num_samples * validation_fraction)
        self.splits = {
            "train": table.select(range(n_val, num_samples)).with_format("numpy"),
            "validation": table.select(range(n_val)).with_format("numpy"),
        }

    def split_size(self, split: str) -> int:
        return len(self.splits[split])

    def collate(self, split: str, keys: list[tuple[int, int, int]]) -> Batch:
        rows = self.splits[split][[k[2] for k in keys]]
        return {
            "features": torch.from_numpy(np.asarray(rows["features"], dtype=np.float32)),
            "label": torch.from_numpy(np.asarray(rows["label"], dtype=np.int64)),
        }


class MLPClassifier(Task):
    def __init__(
        self,
        data: DataModule,
        hidden_size: int,
        num_layers: int,
        dropout: float,
        activation: Literal["gelu", "fp32_softplus"] = "gelu",  # checked in preflight too
    ):
        super().__init__()
        require_kind(data, "vectors", "mlp")
        activations = {"gelu": nn.GELU, "fp32_softplus": Fp32Softplus}
        if activation not in activations:
            raise UserError(
                f"model.activation={activation!r} is invalid: allowed: {', '.join(activations)}"
            )
        layers: list[nn.Module] = []
        width = data.num_features
        for _ in range(num_layers):
            layers += [
                nn.Linear(width, hidden_size),
                activations[activation](),
                nn.Dropout(dropout),
            ]
            width = hidden_size
        layers.append(nn.Linear(width, data.num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(self.net(batch["features"]), batch["label"], reduction="sum")

    def eval_sums(self, batch: Batch) -> dict[str, torch.Tensor]:
        logits = self.predicted(self.net(batch["features"]))
        return {
            "loss": F.cross_entropy(logits, batch["label"], reduction="sum"),
            "accuracy": (logits.argmax(-1) == batch["label"]).sum(),
        }
