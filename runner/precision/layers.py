"""The one way the runner changes what a module's forward does: named layers around it, composed
in a fixed order whatever order they are added in, so that any set of options composes the same.

Outermost first:

1. `checkpoint`: gradient checkpointing (model.gradient_checkpointing) keeps the block's inputs
   and runs everything inside again in backward, so the recomputation repeats the layers below;
2. `island`: an fp32 island (precision.fp32_modules): autocast off, floating inputs to fp32;
3. `cast`: the mode's casts at the module's boundary (bf16_true: inputs to the weights' dtype,
   outputs handed on in the dtype the next module expects);
4. `converted`: a converting mode's switch between the converted Linear and the plain one (staged
   runs; runner/precision/converted.py).

A layer is `fn(module, forward, *args, **kwargs)`: it calls `forward` (the layers inside it and
the module's own forward) as it sees fit. The composed forward is a method bound to the module,
so a deep copy of the model (an evaluation in another dtype) runs its own copy's layers."""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn

ORDER = ("checkpoint", "island", "cast", "converted")
Layer = Callable[..., object]


def _layered_forward(module: nn.Module, *args, **kwargs):
    forward = module._inner_forward
    for name in reversed(ORDER):
        if layer := module._forward_layers.get(name):
            forward = _bind(layer, module, forward)
    return forward(*args, **kwargs)


def _bind(layer: Layer, module: nn.Module, inner):
    return lambda *args, **kwargs: layer(module, inner, *args, **kwargs)


def add(module: nn.Module, name: str, layer: Layer) -> None:
    """Puts `layer` around `module`'s forward at its place in ORDER (a second `name` replaces the
    first). The forward found at the first call is the innermost one."""
    if name not in ORDER:
        raise ValueError(f"unknown forward layer {name!r} (known: {', '.join(ORDER)})")
    if "_forward_layers" not in module.__dict__:
        module._inner_forward = module.forward
        module._forward_layers = {}
        module.forward = types.MethodType(_layered_forward, module)
    module._forward_layers[name] = layer


def has(module: nn.Module, name: str) -> bool:
    """Whether `module`'s forward has the layer `name`."""
    return name in module.__dict__.get("_forward_layers", {})


def recomputing() -> bool:
    """Whether the op running now is a forward run again in backward (gradient checkpointing).
    Autograd runs backward with grad mode off (no `create_graph` here); a checkpoint turns it on
    to record the forward it recomputes, reentrant or not. (A double backward would count here
    too; no task takes one.)"""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1
