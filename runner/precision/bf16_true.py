"""precision=bf16_true: bf16 weights, gradients and optimizer state, no autocast and no fp32 master
copy (Lightning's "bf16-true"): half the weight memory of fp32 and of bf16 autocast.

The forward runs in the weights' dtype. Rather than casting the batch (whose float targets must
stay as they are), every module with weights of its own casts its floating inputs to their dtype:
the first layer takes the fp32 features, a layer after an fp32 island takes its fp32 output, and
norm layers kept in fp32 compute in fp32 and hand bf16 on, so the activations stay bf16. The
task's nets hand their outputs back in fp32, so the loss is computed in fp32 (autocast computes
it so, and Lightning Fabric casts a bf16-true module's outputs back the same way).

An update smaller than half of bf16's spacing at a weight (2⁻⁹ of it) rounds back to the weight
and is lost: at small learning rates training stalls. `precision.update` says how an update goes
into a bf16 weight: `plain` (rounded to nearest), `stochastic_rounding` (up or down with the
odds of its distance: unbiased, so small updates survive on average) or `kahan` (rounded, and
the remainder kept in a bf16 compensation buffer that the next update adds back). Each bf16
weight carries its choice as `bf16_update`; the optimizer that honours it is `runner.train.optim.AdamW`
(built whenever a choice other than plain is made), through `weight` and `write` here. The
compensation buffers are that optimizer's state, saved and resumed with its moments."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from runner.precision import layers


def _cast_to(dtype: torch.dtype):
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    return cast


def _casts(own: bool, out: torch.dtype | None):
    """The `cast` layer of a module: its floating inputs in its own weights' dtype (`own`), and
    its output handed on in `out` (bf16 after an fp32 norm layer, fp32 out of a task's net)."""

    def layer(module: nn.Module, forward, *args, **kwargs):
        if own:
            dtype = next(module.parameters(recurse=False)).dtype
            args, kwargs = tree_map_only(torch.Tensor, _cast_to(dtype), (args, kwargs))
        output = forward(*args, **kwargs)
        return tree_map_only(torch.Tensor, _cast_to(out), output) if out else output

    return layer


def prepare(
    task: nn.Module,
    islands: list[nn.Module],
    norms: set[nn.Module],
    update: str = "plain",
    keep: set[nn.Parameter] = frozenset(),
) -> None:
    """Cast each module's own floating parameters and buffers to bf16, except in fp32 islands
    (and their submodules), in `norms` (the norm layers, where they keep fp32) and the
    parameters in `keep` (a fine-tune's fp32 adapters); give every bf16 weight the update rule
    it takes (`bf16_update`); install the casts at module boundaries (the `cast` layer,
    runner/precision/layers.py): a module computes in its own weights' dtype."""
    kept = {id(m) for island in islands for m in island.modules()}
    nets = set(task.children())
    for module in task.modules():
        norm = module in norms
        if id(module) not in kept and not norm:
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.is_floating_point():
                    setattr(module, name, buffer.to(torch.bfloat16))
            for param in module.parameters(recurse=False):
                if param.is_floating_point() and param not in keep:
                    param.data = param.data.to(torch.bfloat16)
                    param.bf16_update = update
        own = next(module.parameters(recurse=False), None) is not None
        out = (
            torch.float32
            if module in nets
            else torch.bfloat16
            if own and norm and id(module) not in kept
            else None
        )
        if own or out:
            layers.add(module, "cast", _casts(own, out))


def stochastic_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 → bf16, away from zero with the probability of the dropped 16 bits' share of bf16's
    spacing, else towards zero: E[round(x)] = x. (Random low bits added to the bit pattern,
    then cut off.)"""
    bits = x.view(torch.int32) + torch.randint_like(x, 1 << 16, dtype=torch.int32)
    return (bits & -(1 << 16)).view(torch.float32).bfloat16()


def start(param: torch.Tensor, state: dict) -> None:
    """A weight's first step: kahan's compensation buffer (bf16, like the weight)."""
    if getattr(param, "bf16_update", None) == "kahan":
        state["compensation"] = torch.zeros_like(param)


def weight(param: torch.Tensor, state: dict) -> torch.Tensor:
    """The weight the update applies to, in fp32: with kahan, plus what earlier updates left
    over. An fp32 weight is itself (updated in place)."""
    if "compensation" in state:
        return param.float() + state["compensation"]
    return param.float()


def write(param: torch.Tensor, new: torch.Tensor, state: dict) -> None:
    """The updated fp32 weight into the parameter, by its update rule."""
    if getattr(param, "bf16_update", None) == "stochastic_rounding":
        param.copy_(stochastic_round(new))
        return
    param.copy_(new)  # rounded to nearest (a no-op for an fp32 weight updated in place)
    if "compensation" in state:
        state["compensation"].copy_(new.sub_(param))
