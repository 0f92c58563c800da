"""`model.peft`: LoRA adapters on a `model=hf` or `model=module` net, made by the `peft` library
(`peft.get_peft_model`). The net's own weights freeze; the adapters (and what the config adds to
them: `modules_to_save`, trainable biases) are what trains. The net is in fp32 here: the
precision mode casts it later, and `precision.adapter_dtype` says what the adapters hold then
(runner/precision/adapters.py)."""

from __future__ import annotations

from collections.abc import Mapping

from omegaconf import Container, OmegaConf
from torch import nn

from runner import console
from runner.config.tasks import PEFT_ALIASES
from runner.errors import UserError, first_line


def lora_config(spec: Mapping):
    """`model.peft` as a `peft.LoraConfig` (its keys and values were checked by config
    validation: runner/config/tasks.py)."""
    import peft

    kwargs = {  # lists as lists, as LoraConfig takes them
        PEFT_ALIASES.get(key, key): OmegaConf.to_container(v) if isinstance(v, Container) else v
        for key, v in spec.items()
    }
    try:
        return peft.LoraConfig(**kwargs)
    except (TypeError, ValueError) as e:  # e.g. use_dora with a bias, an unknown task_type
        raise UserError(f"model.peft={dict(spec)} is invalid: {first_line(e)}") from None


def add_lora(net: nn.Module, spec: Mapping) -> nn.Module:
    """`net` wrapped by `peft.get_peft_model`, with its trainable share said on the console."""
    import peft

    config = lora_config(spec)
    try:
        # autocast_adapter_dtype is PEFT's rule for a base already in bf16/fp16: here the base
        # is fp32, and precision.adapter_dtype sets the adapters' dtype when the mode casts it.
        wrapped = peft.get_peft_model(net, config, autocast_adapter_dtype=False)
    except (ValueError, TypeError, KeyError) as e:  # no target_modules for this net, a typo
        raise UserError(f"model.peft cannot adapt {type(net).__name__}: {first_line(e)}") from None
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    console.say(
        f"model.peft: LoRA r={config.r} on {_targets(wrapped.peft_config['default'])}: "
        f"{trainable:,} of {total:,} parameters train ({trainable / total:.2%})"
    )
    return wrapped


def _targets(config) -> str:
    """The adapted modules' names (a set once PEFT resolved them), or the pattern given."""
    targets = config.target_modules
    return targets if isinstance(targets, str) else ", ".join(sorted(targets or []))


def describe(net: nn.Module) -> dict:
    """What summary.json says of the adapters (`peft`), or nothing for a net without them."""
    config = getattr(net, "peft_config", {}).get("default")
    if config is None:
        return {}
    return {
        "peft": {
            "r": config.r,
            "alpha": config.lora_alpha,
            "target_modules": _targets(config),
            "adapter_parameters": sum(p.numel() for p in net.parameters() if p.requires_grad),
        }
    }
