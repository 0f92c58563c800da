"""Evaluation: one loop over the validation batches, each batch through one or more `Variant`s of
the task (a model, and the precision context its batches run in). The trainer's evaluation is the
one-variant case, under the training autocast; runner/answers/inference.py runs the final weights
through several precisions at once."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from runner import console
from runner.errors import first_line
from runner.task import Batch, DataModule, Task
from runner.train import distributed

Predictions = list[tuple[str, torch.Tensor]]  # (kind, prediction): Task.predicted's
Compare = Callable[[list], None]  # each variant's Predictions of a batch (None: it ran none)


@dataclass
class Variant:
    """A model to evaluate (the trained task, or a copy of it) and the context it runs in."""

    task: Task
    context: Callable[[], AbstractContextManager] = contextlib.nullcontext
    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # on the device: no sync a batch

    def evaluate(self, index: int, batch: Batch) -> Predictions | None:
        """The batch's metric sums added to the variant's; its predictions (`Task.predicted`)."""
        with self.context(), self.task.predictions_captured() as predictions:
            for key, value in self.task.eval_sums(batch).items():
                self.sums[key] = self.sums.get(key, 0) + value.float()
        return predictions

    def metrics(self, count: int) -> dict[str, float]:
        """The task's metrics over the batches seen, as `eval_<name>`."""
        totals = dict(zip(self.sums, torch.stack(list(self.sums.values())).tolist(), strict=True))
        return {f"eval_{key}": v for key, v in self.task.eval_metrics(totals, count).items()}


@torch.inference_mode()
def run(
    variants: Sequence[Variant], batches: Iterable[Batch], to_device, compare: Compare | None = None
) -> int:
    """Each batch through every variant in turn, so that only one batch's outputs are held at a
    time: `compare` sees each variant's predictions of the batch. Returns the number of targets.
    Under inference_mode linear, matmul, einsum, attention and the convolutions reach a dispatch
    mode whole, not decomposed: the precision audit has a formula for each (flop_formulas.py)."""
    count = 0
    for index, batch in enumerate(batches):
        count += variants[0].task.num_targets(batch)
        batch = to_device(batch)
        predictions = [variant.evaluate(index, batch) for variant in variants]
        if compare is not None:
            compare(predictions)
    return count


@contextlib.contextmanager
def evaluating(*tasks: Task) -> Iterator[None]:
    """Eval mode (dropout off, BatchNorm's running statistics), then each task's mode as found:
    a failed evaluation leaves a training task training, as a finished one does."""
    modes = [task.training for task in tasks]
    for task in tasks:
        task.eval()
    try:
        yield
    finally:
        for task, mode in zip(tasks, modes, strict=True):
            task.train(mode)


class Evaluation:
    """The trainer's evaluation: under inference_mode and the same autocast as training. An error
    inside it (the user's net or validation data) is one warning line and `eval_error` in the
    summary, and evaluation is off for the rest of the run: training goes on, its rows and
    checkpoints as without evaluation."""

    def __init__(
        self,
        task: Task,
        data: DataModule,
        autocast: Callable[[], AbstractContextManager],
        limit_val_batches: int,
        to_device,
        sharded: bool,
    ):
        self.task, self.data, self.autocast = task, data, autocast
        self.limit_val_batches, self.to_device, self.sharded = limit_val_batches, to_device, sharded
        self.error: dict | None = None  # the step whose evaluation failed, and why

    def at(self, step: int) -> dict[str, float]:
        """The metrics at `step`; {} where it fails (and from then on)."""
        if self.error is not None:
            return {}
        try:
            return self.evaluate()
        except Exception as e:
            self.error = {"step": step, "error": first_line(e)}
            console.say(
                f"[yellow]warning:[/] evaluation at step {step} failed: {first_line(e)}; "
                "training goes on without evaluation (summary.json: eval_error)"
            )
            return {}

    def evaluate(self) -> dict[str, float]:
        loader = self.data.val_loader(self.limit_val_batches)
        if loader is None:
            return {}
        variant = Variant(self.task, self.autocast)
        with evaluating(self.task), distributed.gathered(self.task, self.sharded):
            count = run([variant], loader, self.to_device)
        return variant.metrics(count)

    def summary(self) -> dict:
        return {"eval_error": self.error} if self.error else {}
