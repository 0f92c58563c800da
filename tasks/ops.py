"""A custom autograd op that only supports fp32, made safe under autocast the documented way:
`torch.amp.custom_fwd(cast_inputs=torch.float32)` / `custom_bwd`."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _softplus_for(device_type: str) -> type[torch.autograd.Function]:
    """custom_fwd binds a device type, so there is one Function class per device type."""

    class Fp32Softplus(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type=device_type, cast_inputs=torch.float32)
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            if x.dtype != torch.float32:  # stands for a kernel written for fp32 only
                raise TypeError(f"fp32_softplus supports float32 only, got {x.dtype}")
            ctx.save_for_backward(x)
            return torch.log1p(torch.exp(-x.abs())) + x.clamp_min(0)

        @staticmethod
        @torch.amp.custom_bwd(device_type=device_type)
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return grad * torch.sigmoid(x)

    return Fp32Softplus


def fp32_softplus(x: torch.Tensor) -> torch.Tensor:
    return _softplus_for(x.device.type).apply(x)


class Fp32Softplus(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp32_softplus(x)
