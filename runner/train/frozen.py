"""A fine-tune's frozen base in single-file checkpoints (model.peft). The checkpoint holds what
trains (the adapters), the buffers and the optimizer, and leaves the base out, as Hugging Face's
Trainer does with a PEFT model: a LoRA checkpoint of a 7B model is megabytes, not 14 GB a save.
The run's config rebuilds the base on resume, as it built it at the start; a digest of each
left-out tensor (its sum and its sum of magnitudes) is saved instead, and a resume onto a base
that differs is an error rather than a silently different model. A model without adapters
(model.freeze included) is saved whole, as before."""

from __future__ import annotations

import torch

from runner.errors import UserError
from runner.precision.adapters import adapter_parameters

BASE = "frozen_base"  # the checkpoint's key: {name: [dtype, sum, sum of |x|]} of each left out
# Two digests of one tensor agree to this share of its magnitude: summation order (threads, a
# device) moves an fp64 sum by far less; a base that was trained or re-initialised, by far more.
TOLERANCE = 1e-6


def _frozen(task: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The frozen parameters of a task with adapters, by state_dict key (tied ones under each
    name); none without adapters."""
    if not adapter_parameters(task):
        return {}
    named = task.named_parameters(remove_duplicate=False)
    return {name: p for name, p in named if not p.requires_grad}


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    if not tensors:
        return {}
    sums = torch.stack(
        [
            torch.stack(
                [t.sum(dtype=torch.float64), torch.linalg.vector_norm(t, 1, dtype=torch.float64)]
            )
            for t in tensors.values()
        ]
    ).tolist()  # one transfer from the device
    dtypes = (str(t.dtype).removeprefix("torch.") for t in tensors.values())
    return {name: [d, *s] for name, d, s in zip(tensors, dtypes, sums, strict=True)}


def model_state(task: torch.nn.Module) -> dict:
    """A checkpoint's `model`: the task's state_dict less a fine-tune's frozen base, whose
    digests go under BASE."""
    frozen = _frozen(task)
    state = {k: v for k, v in task.state_dict().items() if k not in frozen}
    return {"model": state, **({BASE: _digests(frozen)} if frozen else {})}


def full_state(task: torch.nn.Module, state: dict) -> dict:
    """A checkpoint's `model` made whole for `load_state_dict`: the base it left out is this
    run's own, once its digests match (a tensor in another dtype, resumed across precision, is
    not compared)."""
    saved = state.get(BASE)
    if not saved:
        return state["model"]
    own = _frozen(task)
    if set(own) != set(saved):
        raise UserError(
            "the checkpoint's frozen base does not fit this model: it left out "
            f"{len(saved)} tensors, this model freezes {len(own)} (model.peft changed?)"
        )
    now = _digests(own)
    for name, (dtype, total, magnitude) in saved.items():
        same = now[name][0] == dtype
        moved = max(abs(now[name][1] - total), abs(now[name][2] - magnitude))
        if same and moved > TOLERANCE * max(magnitude, 1e-30):
            raise UserError(
                f"the checkpoint was trained on another frozen base: {name} differs from this "
                "run's (the run rebuilds its base from model.name_or_path or model.net, which "
                "must be the one it trained on)"
            )
    current = task.state_dict()  # in the layout the model saves (converted Linears: their Conv1D's)
    return {**state["model"], **{name: current[name] for name in own}}
