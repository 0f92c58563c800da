"""The losses a user's net can be trained with (`model.loss`), each able to say how many terms it
sums, so that an accumulation window is normalised over all its targets, not per micro-batch."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from hydra.utils import get_object

from runner import console
from runner.errors import UserError, building
from runner.task import Batch

IGNORE_INDEX = -100  # targets to leave out (padding, unmasked tokens), as PyTorch and HF use
MAX_F1_CLASSES = 64  # beyond this, per-class counts in the eval sums cost more than they tell


def shape_of(t: torch.Tensor) -> str:
    return f"[{', '.join(map(str, t.shape))}]"


class Loss(ABC):
    """`total(prediction, target)` sums the loss over the micro-batch's `count(target)` terms."""

    name: str
    target_to_net = False  # the net computes the loss itself and needs the target

    def check(self, target: torch.Tensor | None) -> None:
        """Fails at build time, with one line, on targets this loss cannot use."""
        if target is None:
            raise UserError(
                f"model.loss={self.name} needs a target, but the dataset's items have none: give "
                "(input, target) pairs, or dicts with the target under `labels`"
            )

    def count(self, target: torch.Tensor) -> int:
        return len(target)

    @abstractmethod
    def total(self, prediction, target: torch.Tensor) -> torch.Tensor: ...


class CrossEntropy(Loss):
    """Class indices; the class dimension is dim 1 (PyTorch's convention, e.g. [N, C, H, W]) or
    the last one (token logits [N, T, C]). Targets equal to -100 are left out."""

    name = "cross_entropy"

    def __init__(self, class_dim_last: bool = False):
        self.class_dim_last = class_dim_last

    def check(self, target: torch.Tensor | None) -> None:
        super().check(target)
        if target.is_floating_point() or target.dtype == torch.bool:
            raise UserError(
                f"model.loss=cross_entropy needs integer class targets, but the dataset gives "
                f"{str(target.dtype).removeprefix('torch.')} targets of shape {shape_of(target)} "
                "(use model.loss=mse, or a _target_ loss)"
            )

    def count(self, target: torch.Tensor) -> int:
        return int((target != IGNORE_INDEX).sum())

    def check_classes(self, prediction, target: torch.Tensor) -> None:
        """Fails with one line where targets reach past the classes the net predicts."""
        logits, labels = self.align(prediction, target)
        labels = labels[labels != IGNORE_INDEX]
        classes = logits.shape[-1]
        if len(labels) and (labels.min() < 0 or labels.max() >= classes):
            raise UserError(
                f"model.loss=cross_entropy: the dataset's targets reach class "
                f"{int(labels.max() if labels.max() >= classes else labels.min())}, but the net "
                f"predicts {classes} classes (0–{classes - 1}): give the net {int(labels.max()) + 1} "
                "outputs, or check the targets"
            )

    def align(
        self, prediction: torch.Tensor, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [M, C], labels [M]): the class dimension moved last, both flattened."""
        p, t = tuple(prediction.shape), tuple(target.shape)
        if p[:1] + p[2:] == t and not self.class_dim_last and len(p) > 2:
            prediction = prediction.movedim(1, -1)
        elif p[:-1] != t:
            raise UserError(
                f"model.loss=cross_entropy: the net's output of shape {shape_of(prediction)} does "
                f"not fit targets of shape {shape_of(target)} (it must be the target's shape with a "
                "class dimension at dim 1 or last)"
            )
        return prediction.reshape(-1, prediction.shape[-1]), target.flatten()

    def total(self, prediction, target: torch.Tensor) -> torch.Tensor:
        logits, labels = self.align(prediction, target)
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")

    def eval_sums(self, prediction, target: torch.Tensor) -> dict[str, torch.Tensor]:
        """Loss, accuracy and, for one class per sample, the counts that macro-F1 needs."""
        logits, labels = self.align(prediction, target)
        guess, valid = logits.argmax(-1), labels != IGNORE_INDEX
        sums = {
            "loss": F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"),
            "accuracy": ((guess == labels) & valid).sum(),
        }
        if target.ndim == 1 and logits.shape[-1] <= MAX_F1_CLASSES:
            for c in range(logits.shape[-1]):
                hit, truth = (guess == c) & valid, labels == c
                sums[f"tp_{c}"] = (hit & truth).sum()
                sums[f"fp_{c}"] = (hit & ~truth).sum()
                sums[f"fn_{c}"] = (~hit & truth).sum()
        return sums


class NextTokenCrossEntropy(CrossEntropy):
    """Causal language modelling: position t predicts token t+1 (a Hugging Face model shifts by
    itself only when it computes the loss)."""

    def __init__(self):
        super().__init__(class_dim_last=True)

    def count(self, target: torch.Tensor) -> int:
        return super().count(target[:, 1:])

    def align(
        self, prediction: torch.Tensor, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return super().align(prediction[:, :-1], target[:, 1:])


def macro_f1(totals: dict[str, float]) -> float | None:
    """The mean F1 over the classes that occur in the targets or the predictions."""
    scores = []
    for key in totals:
        if key.startswith("tp_"):
            c = key[3:]
            tp, fp, fn = totals[key], totals[f"fp_{c}"], totals[f"fn_{c}"]
            if tp + fp + fn > 0:
                scores.append(2 * tp / (2 * tp + fp + fn))
    return sum(scores) / len(scores) if scores else None


class MeanSquared(Loss):
    name = "mse"

    def check(self, target: torch.Tensor | None) -> None:
        super().check(target)
        if not target.is_floating_point():
            raise UserError(
                f"model.loss=mse needs floating-point targets, but the dataset gives "
                f"{str(target.dtype).removeprefix('torch.')} targets (class indices? use "
                "model.loss=cross_entropy)"
            )

    def count(self, target: torch.Tensor) -> int:
        return target.numel()

    def total(self, prediction, target: torch.Tensor) -> torch.Tensor:
        if prediction.numel() != target.numel():
            raise UserError(
                f"model.loss=mse: the net's output of shape {shape_of(prediction)} does not match "
                f"targets of shape {shape_of(target)}"
            )
        # Summed in fp32: a bf16 sum over a batch would round away most of its terms.
        return F.mse_loss(prediction.reshape(target.shape).float(), target, reduction="sum")


def _is_scalar(value) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim == 0 and value.is_floating_point()


class NetOutput(Loss):
    """The net returns its loss (a tensor, an object or dict with `loss`, or a tuple holding it as
    its one scalar tensor), a mean over its micro-batch: a window is averaged per micro-batch,
    exact only when they hold equal numbers of targets."""

    name = "output"
    target_to_net = True

    def __init__(self):
        self._told = False  # an unusual place in a tuple is said once, at the build's probe

    def check(self, target: torch.Tensor | None) -> None:
        """Any target, or none: the net knows what it needs."""

    def count(self, target: torch.Tensor | None) -> int:
        return 1

    def total(self, prediction, target: torch.Tensor | None) -> torch.Tensor:
        loss = prediction
        if isinstance(prediction, Mapping):
            loss = prediction.get("loss")
        elif isinstance(prediction, (tuple, list)):
            loss = self._from_tuple(prediction)
        elif not isinstance(prediction, torch.Tensor):
            loss = getattr(prediction, "loss", None)
        if not _is_scalar(loss):
            raise UserError(
                "model.loss=output: the net must return its loss, a scalar tensor (or an object "
                "or dict with a scalar `loss`, or a tuple holding it), but it returned "
                f"{type(prediction).__name__}"
            )
        return loss

    def _from_tuple(self, output: tuple | list) -> torch.Tensor:
        """The tuple's one scalar tensor. Single-file GPTs return `(logits, loss)`, Hugging Face
        models without return_dict `(loss, logits, ...)`: first or last goes without a word,
        anywhere else the run says which element it took."""
        kind, at = type(output).__name__, [i for i, v in enumerate(output) if _is_scalar(v)]
        if len(at) != 1:
            found = f"{len(at)} (elements {', '.join(map(str, at))})" if at else "none"
            raise UserError(
                f"model.loss=output: the net returned a {kind} of {len(output)}, which must hold "
                f"its loss as its one scalar tensor, but holds {found}: return the loss alone, or "
                "use model.loss=cross_entropy on the logits"
            )
        if at[0] not in (0, len(output) - 1) and not self._told:
            console.say(
                f"[yellow]note:[/] model.loss=output: the net returned a {kind} of "
                f"{len(output)}; its loss is element {at[0]}, its one scalar tensor"
            )
            self._told = True
        return output[at[0]]


class UserLoss(Loss):
    """A user's `(prediction, target) -> loss`, a mean or one value per sample or element. Each
    sample counts once: a mean is weighted by the micro-batch's size; per-element values are
    averaged within each sample, then summed."""

    def __init__(self, name: str, fn: Callable):
        self.name, self.fn = name, fn

    def total(self, prediction, target: torch.Tensor) -> torch.Tensor:
        loss = self.fn(prediction, target)
        if loss.ndim == 0:
            return loss.float() * len(target)
        if loss.shape[0] != len(target):
            raise UserError(
                f"model.loss={self.name} returned a loss of shape {shape_of(loss)}: it must be a "
                f"mean, or have one value per sample ({len(target)}) first"
            )
        return loss.float().reshape(len(target), -1).mean(1).sum()


BUILT_IN = {"cross_entropy": CrossEntropy, "mse": MeanSquared, "output": NetOutput}


def make_loss(spec, class_dim_last: bool = False) -> Loss:
    """`spec`: a built-in's name, or a node with `_target_` (a function, or a loss class such as
    `torch.nn.SmoothL1Loss` with its arguments) called as `(prediction, target)`."""
    if isinstance(spec, Mapping) and "_target_" in spec:
        target = spec["_target_"]
        kwargs = {k: v for k, v in spec.items() if k != "_target_"}
        with building("model.loss", spec):
            obj = get_object(target)
            fn = obj(**kwargs) if isinstance(obj, type) else functools.partial(obj, **kwargs)
        return UserLoss(target, fn)
    if spec == "cross_entropy":
        return CrossEntropy(class_dim_last)
    if spec in BUILT_IN:
        return BUILT_IN[spec]()
    raise UserError(
        f"model.loss={spec!r} is invalid: allowed: {', '.join(BUILT_IN)}, or a node with "
        "_target_ (a callable (prediction, target) -> loss)"
    )


def batch_target(batch: Batch) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(the net's inputs, the target): the target is `labels` (or a zoo dataset's `label` or
    `mask`), everything else goes to the net."""
    key = next((k for k in ("labels", "label", "mask") if k in batch), None)
    return {k: v for k, v in batch.items() if k != key}, batch.get(key)
