"""A converted layer replaces a module of the model (runner/precision/converted.py's Linears,
and the plain nn.Linear an evaluation puts back in a converted one's place): what it takes over
from the one it replaces, and transformers' `Conv1D` (GPT-2's projections, an nn.Linear with its
weight stored (in, out)) as the `nn.Linear` it computes, saved and loaded in the Conv1D's layout
still."""

from __future__ import annotations

from torch import nn

from runner.precision import layers

# What a module that replaces another takes over from it (besides its weights): the forward and
# backward hooks torch keeps on it (the runner's own forward layers are carried by `layers`)
HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def is_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D` (GPT-2's projections): an nn.Linear with its weight stored (in, out)."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and weight is not None and weight.ndim == 2


def dims(linear: nn.Module) -> tuple[int, int]:
    """A Linear's (in, out) features; a Conv1D's weight is stored (in, out)."""
    if is_conv1d(linear):
        return tuple(linear.weight.shape)
    return linear.in_features, linear.out_features


def as_linear(conv: nn.Module) -> nn.Linear:
    """The `nn.Linear` a `Conv1D` computes, for torchao to convert: its weight transposed (a new
    parameter, as trainable as the Conv1D's), its bias the Conv1D's own. It saves and loads its
    weight in the Conv1D's layout, so that checkpoints hold the model's own layout."""
    n_in, n_out = conv.weight.shape
    linear = nn.Linear(n_in, n_out, bias=conv.bias is not None, device="meta")
    weight = conv.weight.detach().t().contiguous()
    linear.weight = nn.Parameter(weight, requires_grad=conv.weight.requires_grad)
    linear.bias = conv.bias
    return linear


def carry(old: nn.Module, new: nn.Module) -> None:
    """`new` replaces `old` in the model: it takes the old one's mode, hooks and forward layers
    (an fp32 island's, bf16_true's casts); a Conv1D's replacement, its saved layout."""
    new.train(old.training)
    for attr in HOOKS:
        getattr(new, attr).update(getattr(old, attr))
    new._is_full_backward_hook = old._is_full_backward_hook
    for name, layer in old.__dict__.get("_forward_layers", {}).items():
        layers.add(new, name, layer)
    if is_conv1d(old):
        new.register_state_dict_post_hook(_saved_as_conv1d)
        new.register_load_state_dict_pre_hook(_loaded_as_linear)
        new._saved_as_conv1d = True


def _saved_as_conv1d(_module, state_dict: dict, prefix: str, _metadata) -> None:
    state_dict[prefix + "weight"] = state_dict[prefix + "weight"].t()


def _loaded_as_linear(_module, state_dict: dict, prefix: str, *_) -> None:
    if (key := prefix + "weight") in state_dict:
        state_dict[key] = state_dict[key].t()


def saved_transposed(model: nn.Module) -> set[nn.Parameter]:
    """The weights the model saves transposed (those of the Linears that replaced a Conv1D): an
    optimizer's state of them is saved and loaded transposed too (runner/train/checkpoint.py)."""
    return {m.weight for m in model.modules() if m.__dict__.get("_saved_as_conv1d")}


def nothing_converted(skipped: dict[str, str]) -> str:
    """The words for a mode that converted no Linear, each Linear with the rule that kept it:
    the summary, the projection and the comparison say them, prefixed with the mode."""
    rules: dict[str, list[str]] = {}
    for name, why in skipped.items():
        rules.setdefault(why, []).append(name)
    kept = "; ".join(
        f"{', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''}: {why}"
        for why, names in rules.items()
    )
    return (
        "converted no Linear: its matmuls ran in bf16 autocast, as under precision=bf16 "
        f"({kept or 'the model has none'})"
    )
