"""The trained weights alone, for inference in the precision you will deploy
(runner/answers/inference.py): as a plain fp32 model (`trained_weights`, the reference), and as
a copy cast to a dtype (`cast_copy`, a `*_cast` row) with the fp32 islands kept fp32."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from itertools import chain

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from runner.precision import fp32_islands, layers
from runner.precision.conversion import carry
from runner.task import Task

# A training mode's forward layers (runner/precision/layers.py): bf16_true's casts, a converting
# mode's switch
MODE_LAYERS = ("cast", "converted")


def trained_weights(task: Task, masters: Mapping[nn.Parameter, nn.Parameter]) -> Task:
    """The trained weights as a plain fp32 model: the reference each precision is measured
    against, and what the cast copies are made from. Its weights are the fp32 masters where
    there are any (fp16_master's model holds their fp16 copies), the others widened to fp32;
    its modules have none of the training mode's forward layers (MODE_LAYERS), and a converting
    mode's converted Linears are plain `nn.Linear`s again (their hooks and other layers carried);
    the fp32 islands stay. The task itself where it is that already; fp32 tensors are shared."""
    tensors = list(chain(task.parameters(), task.buffers()))
    moded = {
        name: module
        for name, module in task.named_modules()
        if any(layers.has(module, layer) for layer in MODE_LAYERS)
    }
    low = any(t.is_floating_point() and t.dtype != torch.float32 for t in tensors)
    if not (masters or moded or low):
        return task
    memo: dict[int, object] = {}
    for t in tensors:
        source = masters.get(t, t)
        if not source.is_floating_point() or source.dtype == torch.float32:
            memo[id(t)] = source  # shared, and only read
            continue
        wide = source.detach().float()
        memo[id(t)] = (
            nn.Parameter(wide, requires_grad=False) if isinstance(t, nn.Parameter) else wide
        )
    for module in moded.values():  # their layers are not copied (the switch holds the mode)
        kept = {k: v for k, v in module._forward_layers.items() if k not in MODE_LAYERS}
        memo[id(module._forward_layers)] = kept
    plain = copy.deepcopy(task, memo)
    for name, module in moded.items():
        if layers.has(module, "converted"):
            converted = plain.get_submodule(name)
            linear = nn.Linear(
                converted.in_features,
                converted.out_features,
                bias=converted.bias is not None,
                device="meta",
            )
            linear.weight, linear.bias = converted.weight, converted.bias
            carry(converted, linear)
            parent, _, child = name.rpartition(".")
            setattr(plain.get_submodule(parent), child, linear)
    return plain


def _inputs_in_own_dtype(module: nn.Module, args: tuple, kwargs: dict):
    dtype = next(module.parameters(recurse=False)).dtype
    cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
    return tree_map_only(torch.Tensor, cast, (args, kwargs))


def cast_copy(task: Task, dtype: torch.dtype) -> Task:
    """The task as deployed in `dtype`: a copy whose floating weights and buffers are cast as
    `.to(dtype)` casts them (BatchNorm's running statistics too), but whose fp32 islands
    (precision.fp32_modules) stay fp32; each module with weights takes its floating inputs in
    their dtype, as a deployed model is fed (and as it takes an island's fp32 output). The
    trained task is not touched, and the copy is built from cast tensors: no fp32 copy first."""
    kept = {
        id(t)
        for module in task.modules()
        if fp32_islands.is_island(module)
        for t in chain(module.parameters(), module.buffers())
    }
    memo: dict[int, object] = {}
    for t in chain(task.parameters(), task.buffers()):
        if not t.is_floating_point() or id(t) in kept:
            memo[id(t)] = t  # shared, and only read: integer buffers and the islands' weights
            continue
        cast = t.detach().to(dtype)
        memo[id(t)] = (
            nn.Parameter(cast, requires_grad=False) if isinstance(t, nn.Parameter) else cast
        )
    deployed = copy.deepcopy(task, memo)
    for module in deployed.modules():
        if next(module.parameters(recurse=False), None) is not None:
            module.register_forward_pre_hook(_inputs_in_own_dtype, with_kwargs=True)
    return deployed
