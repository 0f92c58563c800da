"""fp32 islands (`precision.fp32_modules`): submodules, by name or fnmatch pattern, whose forward
runs with autocast off and its floating inputs cast to fp32, in every mode, so a staged run,
compile, DDP, FSDP and fp16_master all keep them fp32.

The island is a layer around the forward (runner/precision/layers.py) rather than a pair of
forward hooks: one `with` block that Dynamo traces, and that closes behind itself even when the
forward raises."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from fnmatch import fnmatchcase

import torch

from runner.errors import UserError
from runner.precision import layers
from runner.task import Task


def _fp32(x):
    return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _island(device_type: str, _module: torch.nn.Module, forward, *args, **kwargs):
    with torch.autocast(device_type=device_type, enabled=False):
        return forward(*map(_fp32, args), **{k: _fp32(v) for k, v in kwargs.items()})


def find(model: torch.nn.Module, patterns: Sequence[str]) -> list[torch.nn.Module]:
    """The submodules whose names (as in `named_modules()`) the names or fnmatch patterns match,
    as precision.norm_modules matches names (`*` spans dots: `*.output.dense`), each once; a
    pattern that matches none is one clear error naming it and what the model does have."""
    named = list(model.named_modules())[1:]
    found: dict[int, torch.nn.Module] = {}
    for pattern in patterns:
        matched = {id(m): m for name, m in named if fnmatchcase(name, pattern)}
        if not matched:
            known = ", ".join(n for n, _ in named[:5])
            raise UserError(
                f"precision.fp32_modules: {pattern!r} matches no module of the model "
                f"(names look like: {known}, ...; fnmatch patterns such as '*.output.dense')"
            )
        found |= matched
    return list(found.values())


def output_head(model: torch.nn.Module) -> str:
    """precision.fp32_head: the name of the task's output head (`Task.output_head`), to be one
    more island: its logits in fp32, so the loss taken from them is fp32 too (autocast computes
    cross-entropy in fp32 from what it is given; bf16_true has no autocast). A head tied to the
    input embedding (GPT-2, BERT) shares its weight, which then stays fp32 for both."""
    head = model.output_head() if isinstance(model, Task) else None
    if head is None:
        raise UserError(
            f"precision.fp32_head=true: {type(model).__name__} has no output head to keep in fp32 "
            "(it applies to language models: model=gpt, bert, hf or module; elsewhere name the "
            "module in precision.fp32_modules)"
        )
    return next(name for name, module in model.named_modules() if module is head)


def keep_fp32(
    model: torch.nn.Module, names: Sequence[str], device_type: str
) -> list[torch.nn.Module]:
    """Make each named submodule an fp32 island (a second call is harmless); returns them."""
    found = find(model, names)
    make(found, device_type)
    return found


def make(modules: Sequence[torch.nn.Module], device_type: str) -> None:
    """Make each module an fp32 island (a recipe's all-fp32 rule's Linears too)."""
    for module in modules:
        layers.add(module, "island", functools.partial(_island, device_type))


def is_island(module: torch.nn.Module) -> bool:
    return layers.has(module, "island")
