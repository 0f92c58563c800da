"""Each matmul's measured error (issue 40): on the audited step, and every
precision.error_every_n_steps steps where asked, for every weight-carrying matmul module
(nn.Linear and its converted kinds: torchao's Float8Linear and MXFP8Linear, the FP4 Linears;
GPT-2's Conv1D) and each direction (forward, input_grad, weight_grad):

- the SQNR in dB of the product the run computed against the same product computed in fp32 from
  the same high-precision operands: forward x·Wᵀ from the module's input as it reached the module
  and its weight as the model holds it; input_grad dy·W and weight_grad dyᵀ·x, dy being the
  gradient of the module's output as it reached the module. Signal and noise are summed over the
  step's calls of the module (micro-batches, a module called twice), SQNR = 10·log10(Σ ref² /
  Σ (run − ref)²);
- each operand's amax, and the shares of its nonzero elements flushed to zero and clamped (what
  rounds past the format's largest finite value) when quantized to the run's format for that
  direction (runner/measure/quant_shares.py); dy's, where that format is the cast into fp16 or
  bf16 its consumers made, of dy before that cast (runner/measure/precast_grad.py).

How: module hooks installed for the measured step only, and removed after it. A forward pre-hook
keeps the input and hands the module a view of it (whose gradient is this module's own input
gradient); a forward hook compares the output, hooks it for dy, and hooks the autograd nodes of
the call that hand the weight its gradient (this call's own: apart from any other use of a weight
tied to it, as GPT-2's head is to its embedding, and from another call's use of autocast's cached
cast of it); when the model's forward ends, the ops that consumed each output are hooked for dy's
parts before their cast. Everything the probe computes runs outside the audit's dispatch modes,
autocast and autograd, and a block of rows at a time (runner/measure/error_sums.py): no FLOP, op
or activation of the step's own accounting (its manifest, projection) is the probe's, and its
temporaries add at most a block's worth to the step's peak memory. Under FSDP the weight is the one the module's unit gathered (the whole one,
gathered from the shards, where the unit has resharded it). Not measured: a forward that gradient
checkpointing runs again (the first one is)."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from runner.measure.autograd_edges import consumer_edges, next_node, weight_edges
from runner.measure.error_sums import aside, product_sums
from runner.measure.matmuls import FORWARD, INPUT_GRAD, WEIGHT_GRAD
from runner.measure.precast_grad import PreCast
from runner.measure.quant_shares import ROLES, counts, is_cast, operand_formats
from runner.precision.conversion import is_conv1d
from runner.precision.layers import recomputing


def matmul_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)}


def _whole(t: Tensor) -> Tensor:
    """A parameter as the module holds it now: under FSDP the unsharded one its unit gathered,
    or where the unit has resharded it, the whole one gathered from the shards."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _weight(module: nn.Module) -> Tensor:
    """The module's whole weight, out × in."""
    weight = _whole(module.weight)
    return weight.t() if is_conv1d(module) else weight


class _Call:
    """One call of a module in the measured step: its operands as they reached it (its weight
    read off the module when used: FSDP frees a gathered weight after its unit's forward)."""

    def __init__(self, probe: ErrorProbe, name: str, module: nn.Module, x: Tensor, formats):
        self.probe, self.name, self.formats, self.module = probe, name, formats, module
        self.conv1d = is_conv1d(module)
        self.x = x.detach().reshape(-1, x.shape[-1])
        self.dy: Tensor | None = None
        # where dy's format is a cast (fp16, bf16): its parts before that cast, and its counts
        # in that format from them, per direction (runner/measure/precast_grad.py)
        cast = any(is_cast(formats[d][1][0]) for d in (INPUT_GRAD, WEIGHT_GRAD))
        self.precast = PreCast() if cast else None
        self.dy_counts: dict[str, Tensor] = {}
        self.weight = module.weight  # the one the forward uses (FSDP: its unit's gathered one)
        self.start: int | None = None  # the first autograd node its forward made
        self._dw: Tensor | None = None  # the sum of the weight gradient's parts so far, in fp32
        self._parts = self._seen = 0  # where this call hands the weight its gradient twice
        self._owed = {INPUT_GRAD} if x.requires_grad else set()  # then let go of the operands

    def forward(self, y: Tensor) -> None:
        w, bias = _weight(self.module), self.module.bias
        bias = None if bias is None else _whole(bias)
        run = y.detach().reshape(-1, y.shape[-1])
        self.probe.add(self, FORWARD, product_sums(run, self.x, w, bias), (self.x, w))

    def got_dy(self, dy: Tensor) -> None:
        with aside(dy.device):
            self.dy = dy.detach().reshape(-1, dy.shape[-1])
            high = self.precast and self.precast.before(dy)
            if high is None:
                return
            found: dict = {}  # counted here, so that the gradient before its cast is let go
            for direction in (INPUT_GRAD, WEIGHT_GRAD):
                fmt = self.formats[direction][1][0]
                if is_cast(fmt):
                    if fmt not in found:
                        found[fmt] = counts(high.reshape(self.dy.shape), fmt)
                    self.dy_counts[direction] = found[fmt]

    def got_dx(self, dx: Tensor) -> None:
        with aside(dx.device):
            if self.dy is not None:
                w = _weight(self.module)
                dx = dx.detach().reshape(-1, dx.shape[-1])
                sums = product_sums(dx, self.dy, w.t())
                self.probe.add(self, INPUT_GRAD, sums, (self.dy, w.t()))
            self._settle(INPUT_GRAD)

    def _settle(self, direction: str) -> None:
        """Once both gradients are measured, the operands are let go: the step's memory holds
        none of them longer than its own autograd does."""
        self._owed.discard(direction)
        if not self._owed:
            self.x = self.dy = None

    def hook_weight(self, output: Tensor, weight: Tensor) -> None:
        """Hooks the autograd nodes of this call that hand the weight its gradient."""
        edges = weight_edges(output, weight, self.start)
        self._parts = len(edges)
        if edges:
            self._owed.add(WEIGHT_GRAD)
        for node, index in edges:
            node.register_hook(functools.partial(self._got_dw_part, index))

    def _got_dw_part(self, index: int, grad_inputs, _grad_outputs) -> None:
        """A part of the weight's gradient; the last one measures their sum. No part the engine
        hands on is held past its hook: AccumulateGrad takes a gradient nobody else holds as the
        weight's .grad without a copy."""
        self._seen += 1
        part = grad_inputs[index]
        if self.dy is None or part is None:
            return
        with aside(self.dy.device):
            dw = part.detach() if self._dw is None else self._dw + part.detach().float()
            if self._seen < self._parts:
                self._dw = dw.float().clone()  # its own, not the engine's
                return
            self._dw = None
            run = dw if self.conv1d else dw.t()  # in × out, as autograd's order
            sums = product_sums(run, self.x.t(), self.dy.t())
            self.probe.add(self, WEIGHT_GRAD, sums, (self.dy.t(), self.x.t()))
            self._settle(WEIGHT_GRAD)


class ErrorProbe:
    """While entered, measures every matmul module's error (see the module's docstring); then
    `records()`. `converted`: whether converted Linears run in their format (a staged run's
    other stages run them plain); `fast`: the dtypes whose matmuls the CPU's fast kernels compute
    in fp32 from their rounded operands (runner/precision/cpu_kernels.py)."""

    def __init__(self, model: nn.Module, step: int, converted: bool, fast: frozenset = frozenset()):
        self.model, self.step = model, step
        self.converted, self.fast = converted, fast
        self.tallies: dict[tuple[str, str], dict] = {}
        self._open: dict[nn.Module, list[_Call]] = {}
        self._outputs: dict[tuple, _Call] = {}  # this forward's outputs whose dy is cast
        self._start: int | None = None  # the first autograd node of the model's forward
        self._handles: list = []

    def __enter__(self) -> ErrorProbe:
        for name, module in matmul_modules(self.model).items():
            self._handles += [
                module.register_forward_pre_hook(functools.partial(self._pre, name)),
                module.register_forward_hook(functools.partial(self._post, name)),
            ]
        self._handles += [
            self.model.register_forward_pre_hook(self._model_pre),
            self.model.register_forward_hook(self._model_post),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._open.clear()
        self._outputs.clear()

    def _pre(self, name: str, module: nn.Module, args: tuple):
        if recomputing() or not args or not isinstance(x := args[0], Tensor):
            return None
        device = x.device.type
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        grad = torch.is_grad_enabled()
        with aside(x.device):
            formats = operand_formats(module, autocast, self.converted, self.fast)
            call = _Call(self, name, module, x, formats)
        self._open.setdefault(module, []).append(call)
        if not grad:
            return None
        if module.weight.requires_grad:
            call.start = next_node()
        if x.requires_grad:  # the step's own op: this module's input gradient
            x = x.view_as(x)  # this module's own input gradient
            x.register_hook(call.got_dx)
            return (x, *args[1:])
        return None

    def _post(self, name: str, module: nn.Module, args: tuple, output):
        calls = self._open.get(module)
        if not calls:
            return
        call = calls.pop()
        if isinstance(output, Tensor):
            with aside(output.device):
                call.forward(output)
            if output.requires_grad:
                output.register_hook(call.got_dy)
                call.hook_weight(output, call.weight)
                if call.precast is not None and output.grad_fn is not None:
                    self._outputs[output.grad_fn, output.output_nr] = call

    def _model_pre(self, _model: nn.Module, _args) -> None:
        self._outputs.clear()
        self._start = next_node() if torch.is_grad_enabled() else None

    def _model_post(self, _model: nn.Module, _args, output) -> None:
        """The model's forward is done (a task's computes its loss): every op that consumed a
        module's output exists. Each one that hands that output a part of its gradient is hooked
        for the part before its cast (runner/measure/precast_grad.py)."""
        targets, self._outputs = self._outputs, {}
        if not targets or self._start is None or recomputing():
            return
        roots = [t.grad_fn for t in tree_leaves(output) if isinstance(t, Tensor) and t.grad_fn]
        for node, index, call in consumer_edges(roots, self._start, targets):
            node.register_hook(call.precast.hook(node, index))

    def add(self, call: _Call, direction: str, sums: Tensor, operands) -> None:
        """One product's signal and noise (`sums`), and its operands' counts (under `aside`)."""
        computed, formats = call.formats[direction]
        cast = call.dy_counts.get(direction)  # dy's (the first operand) before its cast
        found = [
            cast if i == 0 and cast is not None else counts(t, f)
            for i, (t, f) in enumerate(zip(operands, formats, strict=True))
        ]
        key = (call.name, direction)
        tally = self.tallies.get(key)
        if tally is None:
            self.tallies[key] = {
                "module": call.name,
                "class": type(self.model.get_submodule(call.name)).__name__,
                "format": computed,
                "formats": [f.name for f in formats],
                "sums": sums,
                "counts": found,
                "calls": 1,
            }
            return
        tally["sums"] = tally["sums"] + sums
        tally["counts"] = [
            torch.cat([a[:3] + b[:3], torch.maximum(a[3:], b[3:])])
            for a, b in zip(tally["counts"], found, strict=True)
        ]
        tally["calls"] += 1

    def records(self) -> list[dict]:
        """One record per module × direction measured: `sqnr_db` (inf: no error), `format`,
        `calls`, and per operand (x, w, dy) its `format`, `amax`, `underflow`, `clamp`."""
        out = []
        for (name, direction), t in self.tallies.items():
            signal, noise = t["sums"].tolist()
            operands = {}
            for role, fmt, c in zip(ROLES[direction], t["formats"], t["counts"], strict=True):
                nonzero, flushed, clamped, amax = c.tolist()
                operands[role] = {
                    "format": fmt,
                    "amax": amax,
                    "underflow": flushed / nonzero if nonzero else 0.0,
                    "clamp": clamped / nonzero if nonzero else 0.0,
                }
            out.append(
                {
                    "step": self.step,
                    "module": name,
                    "class": t["class"],
                    "direction": direction,
                    "format": t["format"],
                    "sqnr_db": sqnr_db(signal, noise),
                    "calls": t["calls"],
                    "operands": operands,
                }
            )
        return out


def sqnr_db(signal: float, noise: float) -> float | None:
    """10·log10(signal / noise); inf where nothing was lost, -inf where the run's product is
    non-finite where fp32's is not (fp16's overflow), None where there is no signal."""
    if not signal > 0 or math.isnan(noise):
        return None if not signal > 0 else math.nan
    if math.isinf(noise) and math.isfinite(signal):
        return -math.inf
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)
