"""Norm layers: the modules whose weights stay fp32 where a mode casts the weights (fp16_master,
bf16_true) and that FSDP gathers in fp32, as precision truth's `norm` column shows them. One rule,
here, for every one of those.

A norm layer is one of torch's norm classes, or a module with no child modules, with parameters,
all of them at most 1-D (an elementwise scale and shift), whose class (or a base class) has "norm"
in its name, in any case: Hugging Face's `LlamaRMSNorm` and `T5LayerNorm`, the `LayerNorm` a
single-file GPT defines for itself. `precision.norm_modules` adds what the rule misses.

The rule reads what a module holds instead of running its forward on a probe input: it costs
nothing, needs no input of the right shape (a norm over channels, a gated norm that takes two
inputs), works on the meta device, and no forward's side effects run before training. A
Linear's 2-D weight never passes it, whatever the class is called; a parameterless module
(spectral norm's `_SpectralNorm`, whose fp32 buffers must follow its weight) has nothing to keep."""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

from torch import nn

from runner.errors import UserError

TORCH_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)


def _looks_like_norm(module: nn.Module) -> bool:
    params = list(module.parameters(recurse=False))
    return (
        next(module.children(), None) is None
        and bool(params)
        and all(p.dim() <= 1 for p in params)
        and any("norm" in c.__name__.lower() for c in type(module).__mro__)
    )


def _named(name: str, module: nn.Module, pattern: str) -> bool:
    """`pattern` (fnmatch) matches the module's name or its class's (FSDP2's `FSDP<Name>`
    subclass still has the class it was made as among its bases)."""
    return fnmatchcase(name, pattern) or any(
        fnmatchcase(c.__name__, pattern) for c in type(module).__mro__
    )


def norm_layers(model: nn.Module, extra: Sequence[str] = ()) -> set[nn.Module]:
    """`model`'s norm layers (the model itself aside): by the rule, and those that an `extra`
    pattern (`precision.norm_modules`) names. A pattern that matches no module is an error."""
    found, unmatched = set(), list(extra)
    for name, module in list(model.named_modules())[1:]:
        named = [p for p in extra if _named(name, module, p)]
        unmatched = [p for p in unmatched if p not in named]
        if named or isinstance(module, TORCH_NORMS) or _looks_like_norm(module):
            found.add(module)
    if unmatched:
        names = ", ".join(n for n, _ in list(model.named_modules())[1:6])
        raise UserError(
            f"precision.norm_modules: {unmatched[0]!r} matches no module's name or class "
            f"(names look like: {names}, ...; fnmatch patterns such as '*.ln_f' or 'MyNorm')"
        )
    return found
