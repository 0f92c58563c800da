"""A fine-tune's adapters (model.peft: PEFT's LoRA) as the precision modes see them: the
parameters that train in a net PEFT wrapped (LoRA's A and B, and what its config adds:
`modules_to_save`, trainable biases), apart from its frozen base.

Mixed modes (fp32, tf32, bf16, fp16) keep both in fp32 under autocast. Where a mode casts the
weights (bf16_true, fp16_master), the frozen base takes the mode's dtype and
`precision.adapter_dtype` says what the adapters hold: `fp32` (PEFT's own rule for a bf16/fp16
base, its `autocast_adapter_dtype`: their updates are not rounded away, and fp16_master needs no
masters) or `base` (the base's dtype: bf16_true's update rule applies to them, fp16_master steps
fp32 masters of them only)."""

from __future__ import annotations

import sys

from torch import nn


def adapter_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The trainable parameters of the PEFT models in `model` (none without one)."""
    peft = sys.modules.get("peft")
    if peft is None:  # no PEFT model exists unless peft was imported (importing it takes seconds)
        return set()
    return {
        p
        for module in model.modules()
        if isinstance(module, peft.PeftModel)
        for p in module.parameters()
        if p.requires_grad
    }


def kept_fp32(cfg, model: nn.Module) -> set[nn.Parameter]:
    """The adapters a mode that casts the weights leaves in fp32 (precision.adapter_dtype)."""
    return adapter_parameters(model) if cfg.adapter_dtype == "fp32" else set()
