"""A checkpoint's modules (runner/train/checkpoint.py saves and restores them): the model,
optimizers and schedules as a checkpoint holds them (a fine-tune's frozen base left out, converted
Linears' transposed weights in the model's own layout, FSDP's by parameter name) and back, and the
check that the state to save is finite."""

from __future__ import annotations

import torch

from runner.errors import UserError, first_line
from runner.precision.conversion import saved_transposed
from runner.train import frozen, sharded


def first_nonfinite(tensors) -> str | None:
    """The name of the first floating tensor of (name, tensor) pairs that holds inf or NaN."""
    return next(
        (name for name, t in tensors if t.is_floating_point() and not torch.isfinite(t).all()),
        None,
    )


def _by_group(states: dict) -> dict:
    """One optimizer (or schedule): its state dict. Several (a GAN): a dict of them by group."""
    return next(iter(states.values())) if len(states) == 1 else states


def _saved_layout(task: torch.nn.Module, optimizer, state: dict) -> dict:
    """An optimizer's state dict with the moments of the weights the model saves transposed (a GPT-2
    `Conv1D` a converting mode made a Linear: runner/precision/conversion.py) transposed too, saving
    or loading: a checkpoint holds the model's own layout, whatever a mode converts in memory."""
    transposed = saved_transposed(task)
    if not transposed:
        return state
    ids = [i for group in state["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    swap = {i for i, p in zip(ids, params, strict=True) if p in transposed}
    moments = {
        i: {
            k: v.t() if i in swap and torch.is_tensor(v) and v.ndim == 2 else v
            for k, v in s.items()
        }
        for i, s in state["state"].items()
    }  # new dicts: a state dict's per-weight dicts are the optimizer's own
    return {**state, "state": moments}


def module_states(
    task: torch.nn.Module, optimizers: dict, schedulers: dict, fsdp: bool = False
) -> dict:
    """FSDP: the model and optimizers by parameter name, as DCP saves them (every rank calls it).
    Else a fine-tune's frozen base is left out (runner/train/frozen.py)."""
    modules = (
        sharded.module_states(task, list(optimizers.values()))
        if fsdp
        else {
            **frozen.model_state(task),
            "optimizer": _by_group(
                {n: _saved_layout(task, o, o.state_dict()) for n, o in optimizers.items()}
            ),
        }
    )
    return {**modules, "scheduler": _by_group({n: s.state_dict() for n, s in schedulers.items()})}


def _saved(state: dict, key: str, objects: dict) -> dict:
    """A checkpoint's optimizers (or schedules) by group name, checked against the task's."""
    saved = state[key] if len(objects) > 1 else {next(iter(objects)): state[key]}
    if set(saved) != set(objects):
        raise UserError(f"the checkpoint's {key}s ({', '.join(saved)}) do not fit this task")
    return saved


def load_modules(
    state: dict, task: torch.nn.Module, optimizers: dict, schedulers: dict, fsdp: bool = False
) -> None:
    """The model, optimizers and schedules from a checkpoint; a mismatch is one clear error. A
    sharded set loads into any layout, a single file into FSDP shards too (`fsdp`)."""
    if "set" in state:
        sharded.load(state["set"], task, list(optimizers.values()))
    elif fsdp:
        sharded.load_whole(state["model"], optimizers, _saved(state, "optimizer", optimizers), task)
    else:
        _load_whole(state, task, optimizers)
    for name, saved in _saved(state, "scheduler", schedulers).items():
        schedulers[name].load_state_dict(saved)


def _load_whole(state: dict, task: torch.nn.Module, optimizers: dict) -> None:
    """A single-file checkpoint into a model whose every rank holds all of it."""
    try:
        task.load_state_dict(frozen.full_state(task, state))
    except RuntimeError as e:
        mismatch = next(
            (
                line.strip()
                for line in str(e).splitlines()
                if "size mismatch" in line or "Missing" in line or "Unexpected" in line
            ),
            first_line(e),
        )
        raise UserError(f"the checkpoint does not fit this model config: {mismatch}") from None
    for name, saved in _saved(state, "optimizer", optimizers).items():
        optimizers[name].load_state_dict(_saved_layout(task, optimizers[name], saved))
