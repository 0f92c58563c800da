"""The precision manifest's record of the audited step (runner/measure/manifest.py holds it
against the plan): each matmul-like op by module (runner/measure/module_stack.py), direction,
operand formats and the format it computed in, with its FLOPs and shapes, and the bytes every
other op moves (the projection's)."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn

from runner.measure.memory import _parts
from runner.measure.module_stack import ModuleStack, _tensors
from runner.measure.truth import short
from runner.precision import cpu_kernels
from runner.precision.fp4_mm import FP4_MM, fp4_mkn
from runner.precision.fp4_quant import format_of_scale

FORWARD, INPUT_GRAD, WEIGHT_GRAD, RECOMPUTE = "forward", "input_grad", "weight_grad", "recompute"
_aten = torch.ops.aten
# Ops that move no memory on a GPU worth counting: they alias, allocate or read a scalar.
_NO_TRAFFIC = {"_local_scalar_dense", "lift_fresh", "set_", "resize_", "record_stream"}
# FP4 data packs two E2M1 values a byte: the projection counts values
_PACKED_FP4 = {torch.uint8, *filter(None, [getattr(torch, "float4_e2m1fn_x2", None)])}
_FP8 = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_ROLES = {"input": "x", "weight": "w", "grad_output": "dy"}  # torchao's GemmInputRole values


def fp4_format(data: torch.Tensor, scales: torch.Tensor) -> str:
    """An FP4 operand of `amp_runner::fp4_mm`: packed E2M1 data and its block scales, named by
    the scales' dtype (E4M3: nvfp4, E8M0: mxfp4) and the tile each scale covers."""
    fmt = format_of_scale(scales)
    rows, cols = data.shape[0] // scales.shape[0], 2 * data.shape[1] // scales.shape[1]
    tile = f"block {cols}" if rows == 1 else f"tile {rows}×{cols}"
    return f"{fmt.name if fmt else '?fp4'} e2m1 {tile}"


def _operands(func, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], tuple[str, ...]]:
    """(floating operands, their formats): an fp4_mm's two FP4 operands (data and scales) each
    one format."""
    if func._overloadpacket is FP4_MM:
        return [args[0], args[3]], (fp4_format(args[0], args[1]), fp4_format(args[3], args[4]))
    operands = [a for a in _tensors((args, kwargs)) if a.is_floating_point()]
    return operands, tuple(dict.fromkeys(operand_format(a) for a in operands))


def operand_format(t: torch.Tensor) -> str:
    """The format an operand holds its values in: its dtype, or the fp8 data a torchao tensor
    wraps (float8 training's scaled tensor, with its scaling; an MX tensor, with its block)."""
    data = getattr(t, "_data", None)
    if isinstance(data, torch.Tensor) and data.dtype in _FP8:
        scaling = "tensorwise" if getattr(t, "_axiswise_dim", None) is None else "rowwise"
        return f"fp8 {_FP8[data.dtype]} {scaling}"
    qdata = getattr(t, "qdata", None)
    if isinstance(qdata, torch.Tensor) and qdata.dtype in _FP8:
        return f"mxfp8 {_FP8[qdata.dtype]} block {getattr(t, 'block_size', '?')}"
    if t.dtype in _FP8:
        return f"fp8 {_FP8[t.dtype]}"
    return short(t.dtype)


class MatmulLog:
    """The audit's record of each matmul-like op: called by `PrecisionAudit` for every op it sees
    (`observe`), inside a `ModuleStack` of the task."""

    def __init__(self, stack: ModuleStack):
        self.stack = stack
        # (module, class, op, direction, format, inputs) → [calls, flops]
        self.ops: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
        # For the projection (runner/measure/projection.py): each matmul record by its operands'
        # and output's shapes → [calls, flops, operand numels, output numel, M/K/N of a 2-D GEMM];
        # every other op that moves memory by (module, class, op) → [calls, bytes read + written]
        self.shapes: dict[tuple, list] = {}
        self.other: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])

    def before(self) -> None:
        cpu_kernels.COMPUTED.dtype = None  # what the fast CPU kernels hand PyTorch's, if they run

    def observe(self, func, args: tuple, kwargs: dict, out, flops: int | None) -> None:
        self._follow_weights(args, kwargs, out)
        if flops is None:
            self._tally(func, args, kwargs, out)
            return
        operands, formats = _operands(func, args, kwargs)
        if not operands:
            return
        name, module = self.stack.current()
        direction = self._direction(func, args, out, operands, module)
        computed = self._computed(func, operands, formats)
        kind = type(module).__name__ if module is not None else "-"
        key = (name, kind, func._overloadpacket.__name__, direction, computed, formats)
        entry = self.ops[key]
        entry[0] += 1
        entry[1] += flops
        self._shape(key, func, operands, out, flops)

    def _follow_weights(self, args: tuple, kwargs: dict, out) -> None:
        """An op whose operands (a 0-dim constant aside) all come from one weight alone makes
        more of it: autocast's cast, a transpose or view, and each step that quantizes it (its
        data and scales: mxfp8's MXTensor, which carries no role), so the matmul that takes it
        is found to take a weight whatever its shape."""
        owners = {self._owner(t) for t in _tensors((args, kwargs)) if t.ndim}
        if len(owners) == 1 and None not in owners:
            owner = owners.pop()
            for t in _tensors(out):
                self.stack.weights[t] = owner

    def _owner(self, t: torch.Tensor) -> str | None:
        """The module whose weight alone `t` comes from, if one does: a tensor subclass (torchao's
        fp8 and MX tensors) by its parts."""
        owner = self.stack.weights.get(t)
        if owner is None and hasattr(t, "__tensor_flatten__"):
            owners = {self._owner(getattr(t, name)) for name in t.__tensor_flatten__()[0]}
            owner = owners.pop() if len(owners) == 1 else None
        return owner

    def _shape(self, key: tuple, func, operands: list, out, flops: int) -> None:
        outputs = [t for t in _tensors(out) if t.is_floating_point()]
        sig = (key, tuple(tuple(a.shape) for a in operands), tuple(tuple(t.shape) for t in outputs))
        entry = self.shapes.get(sig)
        if entry is None:
            mats = [a for a in operands if a.ndim == 2]
            mkn = None
            gemms = {_aten.mm: slice(0, 2), _aten.addmm: slice(-2, None)}
            if hasattr(_aten, "_scaled_mm"):  # fp8 on a GPU: (a, b, scale_a, scale_b, ...)
                gemms[_aten._scaled_mm] = slice(0, 2)
            picked = gemms.get(func._overloadpacket)
            if func._overloadpacket is FP4_MM:  # packed a (M × K/2) @ packed bᵀ (N × K/2)
                mkn = list(fp4_mkn(operands[0].shape, operands[1].shape))
            elif picked is not None and len(mats) >= 2:
                a, b = mats[picked]
                mkn = [int(a.shape[0]), int(a.shape[1]), int(b.shape[1])]
            entry = self.shapes[sig] = [
                0,
                0,
                [a.numel() * (2 if a.dtype in _PACKED_FP4 else 1) for a in operands],
                sum(t.numel() for t in outputs),
                mkn,
            ]
        entry[0] += 1
        entry[1] += flops

    def _tally(self, func, args, kwargs, out) -> None:
        """Bytes an op other than a matmul reads and writes, at the dtypes it ran in (a torchao
        tensor by the data it holds): views, allocations and host reads move none."""
        name = func._overloadpacket.__name__
        if self.stack.probing or func.is_view or name in _NO_TRAFFIC:
            return
        if name.startswith(("empty", "new_empty")):
            return
        tensors = _tensors((args, kwargs)) + _tensors(out)
        moved = sum(p.numel() * p.element_size() for t in tensors for p in _parts(t))
        if not moved:
            return
        module, instance = self.stack.current()
        kind = type(instance).__name__ if instance is not None else "-"
        entry = self.other[(module, kind, name)]
        entry[0] += 1
        entry[1] += moved

    def traffic(self) -> dict:
        """The projection's view of the step: each matmul record split by shape (`operand_numels`,
        `out_numel`, `mkn` for a 2-D GEMM), and the other ops' calls and bytes by module."""
        matmuls = [
            {
                **dict(zip(("module", "class", "op", "direction", "format"), key[:5], strict=True)),
                "inputs": list(key[5]),
                "calls": calls,
                "flops": flops,
                "operand_numels": numels,
                "out_numel": out_numel,
                "mkn": mkn,
            }
            for (key, _, _), (calls, flops, numels, out_numel, mkn) in self.shapes.items()
        ]
        other = [
            {"module": module, "class": kind, "op": op, "calls": calls, "bytes": moved}
            for (module, kind, op), (calls, moved) in self.other.items()
        ]
        return {"matmuls": matmuls, "other": other}

    def _direction(self, func, args, out, operands, module) -> str:
        if self.stack.recomputing():
            return RECOMPUTE
        if torch._C._current_graph_task_id() == -1:
            return FORWARD
        roles = {
            _ROLES.get(getattr(getattr(a, "_gemm_input_role", None), "value", None))
            for a in operands
        }
        roles.discard(None)
        if func._overloadpacket is FP4_MM:  # fp4_mm's operands say what they are
            roles = set(args[6].split(","))
        if roles:  # torchao's fp8 operands say what they are
            return WEIGHT_GRAD if roles == {"dy", "x"} else INPUT_GRAD
        if func._overloadpacket is _aten.convolution_backward:
            mask = args[-1] if isinstance(args[-1], list | tuple) else (True, True, True)
            return "+".join(d for d, on in ((INPUT_GRAD, mask[0]), (WEIGHT_GRAD, mask[1])) if on)
        if any(self._owner(a) is not None for a in operands):
            return INPUT_GRAD  # the weight is an operand: the gradient of the input
        if module is not None and isinstance(out, torch.Tensor):
            shapes = {tuple(p.shape) for p in module.parameters(recurse=False)}
            shapes |= {s[::-1] for s in shapes}
            if tuple(out.shape) in shapes:
                return WEIGHT_GRAD
        return INPUT_GRAD

    @staticmethod
    def _computed(func, operands, formats: tuple) -> str:
        """The arithmetic: nvfp4, mxfp4, fp8 or mxfp8 where an operand is one, else the dtype
        PyTorch's kernel received (the fast CPU kernels' fp32), TF32 where CUDA's fp32 matmuls
        use it."""
        for low in ("nvfp4", "mxfp4", "mxfp8", "fp8"):
            if any(f.startswith(low) for f in formats):
                return low
        dtype = cpu_kernels.COMPUTED.dtype or operands[0].dtype
        if dtype == torch.float32 and operands[0].device.type == "cuda":
            conv = func._overloadpacket in (_aten.convolution, _aten.convolution_backward)
            tf32 = (
                torch.backends.cudnn.allow_tf32 if conv else torch.backends.cuda.matmul.allow_tf32
            )
            return "tf32" if tf32 else "fp32"
        return short(dtype)

    def records(self) -> list[dict]:
        return [
            {
                "module": name,
                "class": kind,
                "op": op,
                "direction": direction,
                "format": computed,
                "inputs": list(formats),
                "calls": calls,
                "flops": flops,
            }
            for (name, kind, op, direction, computed, formats), (calls, flops) in self.ops.items()
        ]


@contextlib.contextmanager
def recording(model: nn.Module) -> Iterator[dict]:
    """Records what runs inside (an evaluation pass): yields {ops, outputs}, filled on exit with
    each matmul's record and each module's output dtypes."""
    from runner.measure.flops import PrecisionAudit  # flops.py's audit takes this module's log

    stack = ModuleStack(model)
    matmuls = MatmulLog(stack)
    recorded: dict = {}
    with stack, PrecisionAudit(matmuls):
        yield recorded
        outputs = {name: sorted(dtypes) for name, dtypes in stack.outputs.items()}
    recorded |= {"ops": matmuls.records(), "outputs": outputs}
