"""Users' nets in which a format stops holding one Linear late in training, whose truth the tests
know (tests/test_autopilot.py): from step K (counted in the net's own training forwards, saved
with its weights) something emerges that one Linear's format cannot carry, while bf16 can.

- `ActivationOutlier` (fp8): from step K one input channel of `body.1` holds 1e6. Its weight
  column is zero and kept zero (a gradient hook), so the product never sees it; but one fp8 scale
  per tensor maps 1e6 to 448 and flushes every other activation to zero: that Linear's forward
  and weight gradient lose everything, its input gradient nothing.
- `GradientOutlier` (nvfp4): from step K one output channel of `body.1` gets a gradient of 1e6
  times the rest's. Its weight row is zero and kept zero, and nothing downstream reads that
  channel, so the true gradients elsewhere are unchanged; but NVFP4's one FP32 scale per tensor
  then leaves every other block's E4M3 scale below its range: the rest of dy flushes to zero in
  both of that Linear's backward GEMMs."""

from __future__ import annotations

import os

import torch
from torch import nn

WIDTH, FEATURES, CLASSES = 64, 32, 8
CHANNEL = 5  # the channel the outlier takes
OUTLIER = 1e6


class _Net(nn.Module):
    """blobs' classifier: Linear(32→64) → GELU → Linear(64→64) [the one] → GELU → Linear(64→64)
    → GELU → Linear(64→8); `emerges_at`: the training forward from which the outlier is there
    (`only_rank`: on that rank alone, under several)."""

    def __init__(self, emerges_at: int = 40, only_rank: int | None = None):
        super().__init__()
        self.here = only_rank is None or int(os.environ.get("RANK", "0")) == only_rank
        self.body = nn.Sequential(
            nn.Linear(FEATURES, WIDTH),
            nn.Linear(WIDTH, WIDTH),
            nn.Linear(WIDTH, WIDTH),
        )
        self.head = nn.Linear(WIDTH, CLASSES)
        self.emerges_at = emerges_at
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))

    @property
    def emerged(self) -> bool:
        return self.here and bool(self.forwards >= self.emerges_at)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.forwards += 1
        h = nn.functional.gelu(self.body[0](features))
        h = self.middle(h)
        h = nn.functional.gelu(self.body[2](h))
        return self.head(h)


def _keep_zero(param: torch.Tensor, index: tuple) -> None:
    """`param[index]` zero from the start, and kept zero: its gradient there is dropped."""
    with torch.no_grad():
        param[index] = 0

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[index] = 0
        return grad

    param.register_hook(hook)


class ActivationOutlier(_Net):
    def __init__(self, emerges_at: int = 40, only_rank: int | None = None):
        super().__init__(emerges_at, only_rank)
        _keep_zero(self.body[1].weight, (slice(None), CHANNEL))

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        if self.emerged:
            h = h.clone()
            h[..., CHANNEL] = OUTLIER
        return nn.functional.gelu(self.body[1](h))


class _Amplify(torch.autograd.Function):
    """Identity forward; backward sets `channel`'s gradient to OUTLIER × the rest's largest."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        dy = dy.clone()
        dy[..., CHANNEL] = OUTLIER * dy.abs().amax().clamp_min(1e-30)
        return dy


class GradientOutlier(_Net):
    def __init__(self, emerges_at: int = 40, only_rank: int | None = None):
        super().__init__(emerges_at, only_rank)
        _keep_zero(self.body[1].weight, (CHANNEL, slice(None)))
        _keep_zero(self.body[1].bias, (CHANNEL,))
        _keep_zero(self.body[2].weight, (slice(None), CHANNEL))  # nothing reads the channel

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        y = self.body[1](h)
        if self.emerged:
            y = _Amplify.apply(y)
        return nn.functional.gelu(y)


class Clean(_Net):
    """The same net with nothing emerging: no unit should move."""

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.body[1](h))
