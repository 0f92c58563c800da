"""Each matmul's measured error (issue 40): on the audited step, and every
precision.error_every_n_steps steps where asked, for every weight-carrying matmul module
(nn.Linear and its converted kinds: torchao's Float8Linear and MXFP8Linear, the FP4 Linears;
GPT-2's Conv1D) and each direction (forward, input_grad, weight_grad):

- the SQNR in dB of the product the run computed against the same product computed in fp32 from
  the same high-precision operands: forward x·Wᵀ from the module's input as it reached the module
  and its weight as the model holds it; input_grad dy·W and weight_grad dyᵀ·x, dy being the
  gradient of the module's output as it reached the module. Signal and noise are summed over the
  step's calls of the module (micro-batches), SQNR = 10·log10(Σ ref² / Σ (run − ref)²);
- each operand's amax, and the shares of its nonzero elements flushed to zero and clamped at the
  format's largest finite value when quantized to the run's format for that direction
  (runner/measure/quant_shares.py).

How: module hooks installed for the measured step only, and removed after it. A forward pre-hook
keeps the input and hands the module a view of it (whose gradient is this module's own input
gradient); a forward hook compares the output, hooks it for dy, and hooks the autograd nodes of
the call that hand the weight its gradient (this call's own, apart from any other use of a weight
tied to it, as GPT-2's head is to its embedding). The fp32 products run outside the audit's
dispatch modes, autocast and autograd: no FLOP, op or activation of the step's own accounting is
theirs. Not measured: a forward that gradient checkpointing runs again (the first one is), and
the weight's gradient where FSDP shards the weights."""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes

from runner import console
from runner.measure.autograd_edges import next_node, weight_edges
from runner.measure.matmuls import FORWARD, INPUT_GRAD, WEIGHT_GRAD
from runner.measure.quant_shares import ROLES, counts, operand_formats
from runner.precision.conversion import is_conv1d
from runner.precision.layers import recomputing

WORST_SHOWN = 3  # modules printed after the audited step's manifest
SHORT = {FORWARD: "fwd", INPUT_GRAD: "dgrad", WEIGHT_GRAD: "wgrad"}


def matmul_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)}


@contextlib.contextmanager
def _aside(device: torch.device):
    """Outside the step's own accounting: no dispatch mode (the audit's, the converted GEMMs' FLOP
    counters), no autograd, no autocast."""
    with _disable_current_modes(), torch.no_grad(), torch.autocast(device.type, enabled=False):
        yield


class _Call:
    """One call of a module in the measured step: its operands as they reached it."""

    def __init__(self, probe: ErrorProbe, name: str, module: nn.Module, x: Tensor, formats):
        self.probe, self.name, self.formats = probe, name, formats
        weight = module.weight.detach()
        self.conv1d = is_conv1d(module)
        self.w = weight.t() if self.conv1d else weight  # out × in
        self.x = x.detach().reshape(-1, x.shape[-1])
        self.bias = None if module.bias is None else module.bias.detach()
        self.dy: Tensor | None = None
        self.start: int | None = None  # the first autograd node its forward made
        self._dw: list = []  # the weight gradient's parts, where it reaches the weight twice
        self._parts = 0
        self._owed = {INPUT_GRAD} if x.requires_grad else set()  # then let go of the operands

    def forward(self, y: Tensor) -> None:
        run = y.detach().reshape(-1, y.shape[-1]).float()
        with _aside(run.device):
            ref = self.x.float() @ self.w.float().t()
            if self.bias is not None:  # the bias added as the layer adds it, then taken away
                bias = self.bias.float()
                run, ref = run - bias, torch.addmm(bias, self.x.float(), self.w.float().t()) - bias
        self.probe.add(self, FORWARD, run, ref, (self.x, self.w))

    def got_dy(self, dy: Tensor) -> None:
        self.dy = dy.detach().reshape(-1, dy.shape[-1])

    def got_dx(self, dx: Tensor) -> None:
        if self.dy is not None:
            with _aside(dx.device):
                ref = self.dy.float() @ self.w.float()
            dx = dx.reshape(-1, dx.shape[-1])
            self.probe.add(self, INPUT_GRAD, dx, ref, (self.dy, self.w.t()))
        self._settle(INPUT_GRAD)

    def _settle(self, direction: str) -> None:
        """Once both gradients are measured, the operands are let go: the step's memory holds
        none of them longer than its own autograd does."""
        self._owed.discard(direction)
        if not self._owed:
            self.x = self.dy = self.w = None
            self._dw = []

    def hook_weight(self, output: Tensor, weight: Tensor) -> None:
        """Hooks the autograd nodes of this call that hand the weight its gradient."""
        edges = weight_edges(output, weight, self.start)
        self._parts = len(edges)
        if edges:
            self._owed.add(WEIGHT_GRAD)
        for node, index in edges:
            node.register_hook(functools.partial(self._got_dw_part, index))

    def _got_dw_part(self, index: int, grad_inputs, _grad_outputs) -> None:
        self._dw.append(grad_inputs[index])
        if len(self._dw) == self._parts and self.dy is not None:
            dw = sum(g.detach().float() for g in self._dw if g is not None)
            with _aside(self.dy.device):
                ref = self.x.float().t() @ self.dy.float()  # in × out, as autograd's order
            run = dw if self.conv1d else dw.t()
            self.probe.add(self, WEIGHT_GRAD, run, ref, (self.dy.t(), self.x.t()))
            self._settle(WEIGHT_GRAD)


class ErrorProbe:
    """While entered, measures every matmul module's error (see the module's docstring); then
    `records()`. `converted`: whether converted Linears run in their format (a staged run's
    other stages run them plain); `weight_grads`: off where weights are sharded (FSDP)."""

    def __init__(self, model: nn.Module, step: int, converted: bool, weight_grads: bool = True):
        self.model, self.step = model, step
        self.converted, self.weight_grads = converted, weight_grads
        self.tallies: dict[tuple[str, str], dict] = {}
        self._open: dict[nn.Module, list[_Call]] = {}
        self._handles: list = []

    def __enter__(self) -> ErrorProbe:
        for name, module in matmul_modules(self.model).items():
            self._handles += [
                module.register_forward_pre_hook(functools.partial(self._pre, name)),
                module.register_forward_hook(functools.partial(self._post, name)),
            ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._open.clear()

    def _pre(self, name: str, module: nn.Module, args: tuple):
        if recomputing() or not args or not isinstance(x := args[0], Tensor):
            return None
        device = x.device.type
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        formats = operand_formats(module, autocast, self.converted)
        call = _Call(self, name, module, x, formats)
        self._open.setdefault(module, []).append(call)
        if not torch.is_grad_enabled():
            return None
        if self.weight_grads and module.weight.requires_grad:
            call.start = next_node()
        if x.requires_grad:
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
            call.forward(output)
            if output.requires_grad:
                output.register_hook(call.got_dy)
                call.hook_weight(output, module.weight)

    def add(self, call: _Call, direction: str, run: Tensor, ref: Tensor, operands) -> None:
        """One product's signal and noise, and its operands' counts."""
        with _aside(ref.device):
            noise = (run.float() - ref).double().square().sum()
            signal = ref.double().square().sum()
            computed, formats = call.formats[direction]
            found = [counts(t, f) for t, f in zip(operands, formats, strict=True)]
        key = (call.name, direction)
        tally = self.tallies.get(key)
        if tally is None:
            self.tallies[key] = {
                "module": call.name,
                "class": type(self.model.get_submodule(call.name)).__name__,
                "format": computed,
                "formats": [f.name for f in formats],
                "sums": torch.stack([signal, noise]),
                "counts": found,
                "calls": 1,
            }
            return
        tally["sums"] = tally["sums"] + torch.stack([signal, noise])
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


def worst(records: list[dict], k: int | None = None) -> list[dict]:
    """Each module's lowest-SQNR direction, lowest first (an unmeasured SQNR last); `k` of them."""
    by_module: dict[str, dict] = {}
    for r in sorted(records, key=_rank):
        by_module.setdefault(r["module"], r)
    return list(by_module.values())[:k]


def _rank(r: dict) -> float:
    s = r["sqnr_db"]
    return math.inf if s is None or (isinstance(s, float) and math.isnan(s)) else s


def line(r: dict) -> str:
    """A record in a few words: module, direction, format, SQNR, and its worst operand's shares."""
    s = r["sqnr_db"]
    sqnr = "no error" if s == math.inf else "—" if s is None else f"{s:.1f} dB"
    text = f"{r['module'] or 'the model'} {SHORT.get(r['direction'], r['direction'])}"
    text += f" ({r['format']}): SQNR {sqnr}"
    role, o = max(r["operands"].items(), key=lambda kv: kv[1]["underflow"] + kv[1]["clamp"])
    if o["underflow"] or o["clamp"]:
        text += f", {role} {o['underflow']:.1%} flushed to zero, {o['clamp']:.1%} clamped"
    return text + f", {role} amax {o['amax']:.3g}"


def show(records: list[dict], step: int) -> None:
    """The k worst modules of a measured step, a line each, under the precision manifest."""
    if not records:
        return
    modules = len({r["module"] for r in records})
    picked = worst(records, WORST_SHOWN)
    console.say(f"matmul error, step {step}: the {len(picked)} worst of {modules} modules")
    for r in picked:
        console.console.print(f"  {line(r)}", soft_wrap=True, highlight=False, markup=False)
