"""Resuming a checkpoint written under another precision mode (trainer.resume_across_precision):
refused by default, else converted for this run's mode, each change said."""

from __future__ import annotations

from collections import Counter

import torch

from runner import console
from runner.errors import UserError


def convert_precision(state: dict, task: torch.nn.Module, precision, allowed: bool) -> dict | None:
    """After the modules are loaded: a checkpoint written under another precision mode is
    refused, or with `allowed` (trainer.resume_across_precision) converted for this run's mode;
    returns what changed ({from, to, changes}, also said on the console), None for the same mode.
    fp16_master's fp32 masters go into the weights, not their fp16 copies; this run's masters are
    made from the checkpoint's weights; its GradScaler is dropped where this mode scales no loss."""
    saved, mode = state.get("precision"), precision.name
    if saved is None or saved == mode:
        return None
    if not allowed:
        raise UserError(
            f"the checkpoint was written under precision={saved}, this run is precision={mode}: "
            f"resume with precision={saved}, or set trainer.resume_across_precision=true to "
            "convert it"
        )
    # A sharded set (FSDP) loads through DCP, in this run's dtypes: it has no "model" to read.
    model, params, changes = state.get("model", {}), dict(task.named_parameters()), []
    masters, owners = state.get("master_weights") or [], []
    if masters and not precision.master:
        # fp16_master keeps a master for each trainable weight it cast to fp16, in model order
        owners = [n for n, p in params.items() if p.requires_grad and model[n].dtype == torch.half]
        if [model[n].shape for n in owners] != [m.shape for m in masters]:
            raise UserError(
                f"the precision={saved} checkpoint's fp32 master weights do not fit this model"
            )
        # as the checkpoint's tensors load: in the layout the model saves (converted Linears,
        # GPT-2's Conv1D's), whatever the mode converted in memory
        task.load_state_dict(dict(zip(owners, masters, strict=True)), strict=False)
        changes.append(f"its fp32 master weights ({len(masters)}) loaded, not their fp16 copies")
    elif precision.master and not masters:
        names = {p: n for n, p in params.items()}
        state["master_weights"] = [model[names[p]].float() for p in precision.master.masters]
        changes.append("fp32 master weights made from its weights")
    current = task.state_dict()
    casts = Counter(
        (_dtype(value), _dtype(current[key]))
        for key, value in model.items()
        if key not in owners and value.is_floating_point() and value.dtype != current[key].dtype
    )
    changes += [f"{n} tensors from {a} to {b}" for (a, b), n in casts.items()]
    scaler, keeps_scaler = state.get("scaler"), precision.state_dict()["scaler"] is not None
    if scaler and not keeps_scaler:
        changes.append(f"its GradScaler (scale {scaler['scale']:g}) dropped: {mode} scales no loss")
    elif keeps_scaler and not scaler:
        changes.append("the GradScaler starts at precision.grad_scaler.init_scale")
    console.say(f"resuming a precision={saved} checkpoint as {mode}: {'; '.join(changes)}")
    return {"from": saved, "to": mode, "changes": changes}


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
