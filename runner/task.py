"""The contract between the engine and what it trains. Tasks live in `tasks/`; the engine only
knows these two base classes."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from runner.errors import UserError

Batch = dict[str, torch.Tensor]
# What a task's prediction is, for comparing evaluations in several precisions (`Task.predicted`):
DISTRIBUTION = "distribution"  # logits, classes last: compared by KL divergence
VALUES = "values"  # regression or segmentation outputs: compared by relative error


class Task(nn.Module, ABC):
    """A model plus its loss. `forward` returns the loss *summed* over the batch's targets, so the
    engine can normalise over a whole accumulation window (by tokens for token losses).

    A task with several optimizers (a GAN) returns one loss per parameter group, as a dict keyed
    like `parameter_groups()`, each from its own graph (each is scaled and backpropagated)."""

    @abstractmethod
    def forward(self, batch: Batch) -> torch.Tensor | dict[str, torch.Tensor]: ...

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """One optimizer per group."""
        return {"model": [p for p in self.parameters() if p.requires_grad]}

    def shard_units(self) -> list[nn.Module]:
        """The blocks FSDP shards one by one (e.g. transformer layers), so that each is gathered
        only while it computes; the rest is sharded as one unit."""
        return []

    def output_head(self) -> nn.Module | None:
        """A language model's output projection, the module its logits come out of
        (precision.fp32_head keeps it fp32); None where the task has none."""
        return None

    def num_targets(self, batch: Batch) -> int:
        """How many terms `forward` sums; read from the host-side batch, so no device sync."""
        return len(next(iter(batch.values())))

    def num_tokens(self, batch: Batch) -> int:
        return self.num_targets(batch)

    def eval_sums(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Metric sums over the batch's targets, added up over the evaluation batches."""
        return {"loss": self(batch)}

    def eval_metrics(self, totals: dict[str, float], count: int) -> dict[str, float]:
        """The metrics from the summed `eval_sums` and the number of targets: means by default."""
        return {key: value / max(count, 1) for key, value in totals.items()}

    _predictions: list[tuple[str, torch.Tensor]] | None = None  # while an evaluation captures

    def predicted(self, prediction: torch.Tensor, kind: str = DISTRIBUTION) -> torch.Tensor:
        """`eval_sums` passes the prediction its metrics come from through here (logits with the
        classes last, or VALUES), so that evaluations in several precisions can compare outputs
        (runner.eval_precisions). It comes back in fp32, as autocast computes losses."""
        if self._predictions is not None:
            self._predictions.append((kind, prediction))
        return prediction.float()

    @contextlib.contextmanager
    def predictions_captured(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The (kind, prediction) pairs `predicted` sees inside the block."""
        self._predictions = found = []
        try:
            yield found
        finally:
            del self._predictions

    def describe(self) -> dict:
        """What the summary should say about the model beyond its size (e.g. where it came from)."""
        return {}


def sample_rng(*key: int) -> np.random.Generator:
    """A generator fixed by (seed, stream, epoch, index): per-sample randomness (e.g. masking) that
    does not depend on batch size, worker count or where a run was resumed."""
    return np.random.default_rng(list(key))


class _StreamSampler(Sampler):
    """Batches of (epoch, index) keys from an endless stream of per-epoch permutations. The stream
    is cut into batches without regard to epoch ends, so batch size k·b sees the same samples, in
    the same order, as k batches of size b. With several ranks, each global batch of ranks × b is
    dealt out in rank order, so N ranks see what one process with batch N·b sees."""

    def __init__(
        self,
        size: int,
        batch_size: int,
        seed: int,
        start_sample: int = 0,
        rank: int = 0,
        world: int = 1,
    ):
        self.size, self.batch_size, self.seed, self.start = size, batch_size, seed, start_sample
        self.rank, self.world = rank, world

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, offset = divmod(self.start, self.size)
        batch: list[tuple[int, int]] = []
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        while True:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.size)
            for index in order[offset:]:
                batch.append((epoch, int(index)))
                if len(batch) == self.batch_size * self.world:
                    yield batch[mine]
                    batch = []
            epoch, offset = epoch + 1, 0


class _Fetch(Dataset):
    def __init__(self, data: DataModule, split: str, stream: int):
        self.data, self.split, self.stream = data, split, stream

    def __getitem__(self, keys: list[tuple[int, int]]) -> Batch:
        return self.data.collate(self.split, [(self.stream, e, i) for e, i in keys])


class DataModule(ABC):
    """Map-style splits (`split_size`) fetched a batch at a time (`collate`). Subclasses set
    `batch_size`, `seed`, `num_workers` and `kind` (what models it suits)."""

    kind = "generic"
    batch_size: int
    seed: int
    num_workers: int = 0

    @abstractmethod
    def split_size(self, split: str) -> int: ...

    @abstractmethod
    def collate(self, split: str, keys: list[tuple[int, int, int]]) -> Batch:
        """Build one batch from (stream, epoch, index) keys; use `sample_rng(seed, *key)`."""

    def _loader(self, split: str, stream: int, sampler) -> DataLoader:
        return DataLoader(
            _Fetch(self, split, stream),
            sampler=sampler,
            batch_size=None,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            # Its own generator: a loader draws a seed when iterated, and drawing it from the
            # global RNG would shift dropout's stream between a run and its resumption.
            generator=torch.Generator().manual_seed(self.seed),
        )

    def train_loader(self, start_sample: int = 0, rank: int = 0, world: int = 1) -> DataLoader:
        """`start_sample` counts samples of all ranks together."""
        size = self.split_size("train")
        sampler = _StreamSampler(size, self.batch_size, self.seed, start_sample, rank, world)
        return self._loader("train", 0, sampler)

    def val_loader(self, max_batches: int) -> DataLoader | None:
        size = self.split_size("validation")
        if size == 0:
            return None
        n = min(size, max_batches * self.batch_size)
        keys = [
            [(0, i) for i in range(s, min(s + self.batch_size, n))]
            for s in range(0, n, self.batch_size)
        ]
        return self._loader("validation", 1, keys)

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "batch_size": self.batch_size,
            "train_size": self.split_size("train"),
        }


def require_kind(data: DataModule, kind: str, model: str) -> None:
    """A model's check that the dataset gives what it consumes."""
    if data.kind != kind:
        raise UserError(
            f"model={model} needs a {kind} dataset, but the dataset gives {data.kind} data "
            f"(pick a {kind} dataset, or leave dataset= out for the model's default)"
        )


@contextlib.contextmanager
def buffers_kept(module: torch.nn.Module):
    """The module's buffers are put back as they were found."""
    saved = [b.clone() for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(module.buffers(), saved, strict=True):
                buffer.copy_(value)
