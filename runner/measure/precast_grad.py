"""A module output's gradient before its cast into the output's dtype (the matmul-error probe's
dy, runner/measure/matmul_error.py). Under autocast a Linear's output is fp16 or bf16 and its
gradient arrives already cast into that dtype by the ops that consumed it: an upcast's backward
(`.float()`, autocast's fp32 ops: the loss, softmax, layer norm) casts the fp32 gradient down,
and autograd casts a type-promoting op's (an add into an fp32 residual stream) to the output's
dtype. What that cast flushed to zero arrives as zero: fp16's gradient underflow is invisible in
the gradient as it arrives. Each consumer's part is taken here before its cast, from the
consumer's backward node (its gradient output, for the ops that pass it on unchanged: a cast, an
add, a subtraction; any other consumer's part as it computed it), and their sum is the gradient
the cast rounded: checked against the gradient that arrived (the parts cast and summed in the
output's dtype, in the order autograd summed them), and not used where they differ (a consumer
the probe did not see)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from runner.measure.error_sums import aside

_PASSING = {"ToCopyBackward0": (1.0, 1.0), "AddBackward0": (1.0, 1.0), "SubBackward0": (1.0, -1.0)}


class PreCast:
    """The parts of one tensor's gradient from its consumers' backward nodes, as they were
    before their cast into its dtype (`hook`), and their sum once the gradient has arrived
    (`before`)."""

    def __init__(self):
        self._high: Tensor | None = None  # the parts before their casts, summed
        self._low: Tensor | None = None  # the parts after them, summed as autograd sums them

    def hook(self, node, index: int):
        """A hook for `node`, which hands the tensor a part of its gradient at input `index`."""
        signs = _PASSING.get(type(node).__name__)
        factor = None
        if signs is not None:
            alpha = getattr(node, "_saved_alpha", None) if index else None
            factor = signs[min(index, 1)] * (1 if alpha is None else alpha)
        return functools.partial(self._part, index, factor)

    def _part(self, index: int, factor, grad_inputs, grad_outputs) -> None:
        low = grad_inputs[index]
        if low is None:
            return
        with aside(low.device):
            high = None if factor is None else grad_outputs[0]
            if high is None or high.shape != low.shape:
                high = low
            elif factor != 1:
                high = high * factor
            high, low = high.detach(), low.detach()
            if self._high is None:
                self._high, self._low = high, low
            else:
                wide = torch.promote_types(
                    torch.promote_types(high.dtype, torch.float32), low.dtype
                )
                self._high = self._high.to(wide) + high.to(wide)
                self._low = self._low + low

    def before(self, arrived: Tensor) -> Tensor | None:
        """The gradient before its casts, where the parts seen sum to the one that `arrived`;
        else None. The parts are let go."""
        high, low, self._high, self._low = self._high, self._low, None, None
        if high is None or low is None or low.dtype != arrived.dtype:
            return None
        with aside(arrived.device):
            return high if torch.equal(low, arrived) else None
