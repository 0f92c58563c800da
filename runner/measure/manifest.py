"""The precision manifest: what every matmul of the audited step really ran in, observed at the
dispatcher (the audit's dispatch mode), whatever a mode believes it did, and held against the
plan, what the config asked for.

Per module (its qualified name) and matmul-like op (every op with a FLOP formula: mm, addmm,
bmm, baddbmm, convolution and its backward, scaled-dot-product attention, torchao's fp8 and MX
GEMMs): the direction (forward, gradient of the input, gradient of the weight, a forward that
gradient checkpointing recomputes), its operands' formats and the format it computed in, and its
FLOPs. Per parameter: trainable or not, changed over the run or not (a digest at the start and
at the end), and the dtypes precision truth read off it (weights, gradients, master, optimizer
state). The plan: fp32 islands (and `fp32_head`) compute in fp32 in all directions; fp8 and
mxfp8 compute their converted Linears in their format and every other Linear is listed with its
reason; every other matmul computes in the mode's arithmetic (in fp32 where `cpu_kernels`
computes it so); frozen parameters never change and hold no optimizer state. Each difference is
one line; `plan_held` is False where there is one."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator

import torch
import torch.utils.checkpoint
from rich.markup import escape
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from runner import console
from runner.measure.memory import _parts, local
from runner.measure.truth import short
from runner.precision import cpu_kernels
from runner.precision.fp4 import FP4_MM, format_of_scale
from runner.precision.fp32_islands import is_island
from runner.precision.layers import recomputing
from runner.precision.modes import mode_of

FORWARD, INPUT_GRAD, WEIGHT_GRAD, RECOMPUTE = "forward", "input_grad", "weight_grad", "recompute"
_aten = torch.ops.aten
# Ops whose output holds the values of their first operand: a weight stays a weight through them
# (autocast's cast, a transpose, a view), so the matmul that takes it is found to take a weight.
_SAME_VALUES = {
    _aten._to_copy,
    _aten.t,
    _aten.transpose,
    _aten.permute,
    _aten.view,
    _aten._unsafe_view,
    _aten.reshape,
    _aten.expand,
    _aten.alias,
    _aten.detach,
    _aten.clone,
}
# Ops that move no memory on a GPU worth counting: they alias, allocate or read a scalar.
_NO_TRAFFIC = {"_local_scalar_dense", "lift_fresh", "set_", "resize_", "record_stream"}
# FP4 data packs two E2M1 values a byte: the projection counts values
_PACKED_FP4 = {torch.uint8, *filter(None, [getattr(torch, "float4_e2m1fn_x2", None)])}
_FP8 = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_ROLES = {"input": "x", "weight": "w", "grad_output": "dy"}  # torchao's GemmInputRole values


def _depth(name: str) -> int:
    return name.count(".") + 1 if name else 0


def _next_node_number() -> int:
    """The sequence number the next autograd node made on this thread gets (a probe's)."""
    return (torch.zeros((), requires_grad=True) * 1).grad_fn._sequence_nr() + 1


class ModuleStack:
    """Which of the model's modules is running. In forward, and in a forward that gradient
    checkpointing recomputes in backward, the module's forward hooks enter and leave it. In
    backward, each autograd node belongs to the innermost module whose forward made it (found
    from the module's outputs back to the nodes made before it ran), and a hook before each
    node runs names its module: a gradient that several modules add to (an input shared by a
    LoRA adapter and its base layer) is still each module's own."""

    def __init__(self, model: nn.Module):
        self.names = weakref.WeakKeyDictionary({m: n for n, m in model.named_modules()})
        self._by_name = dict(model.named_modules())  # held only while the audit lasts
        self.probing = False
        self.forward: list[str] = []
        self.recomputed: list[str] = []  # the modules a recomputed forward is inside
        self.backward = ""  # the module whose autograd node runs now
        self.outputs: dict[str, set[str]] = defaultdict(set)  # module → its outputs' dtypes
        self.weights = WeakTensorKeyDictionary()  # tensor → the module name it is a weight of
        self._starts: list[int | None] = []
        self._owned: dict = {}  # autograd node → its module's name
        self._handles: list = []

    def __enter__(self) -> ModuleStack:
        # A recomputation runs its block's forward to the end (not only as far as backward needs
        # it), so each module it enters is left.
        self._early_stop = torch.utils.checkpoint.set_checkpoint_early_stop(False)
        self._early_stop.__enter__()
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._before),
            nn.modules.module.register_module_forward_hook(self._after),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._owned.clear()
        self._early_stop.__exit__(*exc)

    def recomputing(self) -> bool:
        """Whether a forward runs again in backward now: inside a module entered so (ops in an
        autograd Function's forward run with grad off), or `recomputing()`."""
        return bool(self.recomputed) or recomputing()

    def current(self) -> tuple[str, nn.Module | None]:
        """The module running now: its name and the module (None outside the model)."""
        if self.recomputed:
            name = self.recomputed[-1]
        elif torch._C._current_graph_task_id() != -1:
            name = self.backward
        else:
            name = self.forward[-1] if self.forward else ""
        return name, self._by_name.get(name)

    def _before(self, module: nn.Module, args) -> None:
        name = self.names.get(module)
        if name is None:
            return
        (self.recomputed if self.recomputing() else self.forward).append(name)
        # FSDP gathers the weights the forward uses into tensors of their own: those are known here
        for p in module.parameters(recurse=False):
            self.weights[p] = name
        self.probing = True  # the probe's own ops are the audit's, not the model's traffic
        self._starts.append(_next_node_number() if torch.is_grad_enabled() else None)
        self.probing = False

    def _after(self, module: nn.Module, args, output) -> None:
        name = self.names.get(module)
        if name is None:
            return
        running = self.recomputed if self.recomputed else self.forward
        if name in running:
            del running[len(running) - 1 - running[::-1].index(name)]
        start = self._starts.pop() if self._starts else None
        self.outputs[name] |= {short(t.dtype) for t in _tensors(output) if t.is_floating_point()}
        if start is not None:
            self._own(name, start, output)

    def _own(self, name: str, start: int, output) -> None:
        """Claims for `name` the autograd nodes its forward made that no inner module claimed."""
        todo = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        seen = set()
        while todo:
            node = todo.pop()
            if node is None or node in seen or type(node).__name__ == "AccumulateGrad":
                continue
            seen.add(node)
            if node._sequence_nr() < start:
                continue  # made before this forward began: an input's
            if node not in self._owned:
                self._owned[node] = name
                self._handles.append(node.register_prehook(functools.partial(self._running, name)))
            todo.extend(following for following, _ in node.next_functions)

    def _running(self, name: str, _grad_outputs) -> None:
        self.backward = name


def _tensors(value) -> list[torch.Tensor]:
    flat = torch.utils._pytree.tree_flatten(value)[0]
    return [t for t in flat if isinstance(t, torch.Tensor)]


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
        if func._overloadpacket in _SAME_VALUES and args and isinstance(args[0], torch.Tensor):
            if (owner := self.stack.weights.get(args[0])) is not None:
                for t in _tensors(out):
                    self.stack.weights[t] = owner
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
            if picked is not None and len(mats) >= 2:
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
        if any(a in self.stack.weights for a in operands):
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


# --- the plan -------------------------------------------------------------------------------


def digests(model: nn.Module) -> dict[str, tuple[float, float]]:
    """Each parameter's (sum, sum of magnitudes) in float64, of the shard this rank holds: equal
    at start and end exactly where the parameter did not change (a transpose keeps them)."""
    named = dict(model.named_parameters())
    if not named:
        return {}
    sums = torch.stack(
        [
            torch.stack(
                [
                    local(p).detach().sum(dtype=torch.float64),
                    local(p).detach().abs().sum(dtype=torch.float64),
                ]
            ).cpu()
            for p in named.values()
        ]
    ).tolist()
    return {name: tuple(s) for name, s in zip(named, sums, strict=True)}


class Plan:
    """What the config asked of the model, read before the run changes it: the fp32 islands
    and the frozen parameters (model.freeze, a LoRA base), by name."""

    def __init__(self, model: nn.Module, precision):
        self.frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        # modules all of whose own parameters are frozen: no weight gradient to compute
        self.frozen_modules = {
            n
            for n, m in model.named_modules()
            if (own := list(m.parameters(recurse=False))) and not any(p.requires_grad for p in own)
        }
        self.precision = precision
        self.model = model
        self.start: dict[str, tuple[float, float]] = {}

    def started(self) -> None:
        """The digests the run starts from (after its preparation and any resume)."""
        self.start = digests(self.model)

    def islands(self) -> list[str]:
        return [n for n, m in self.model.named_modules() if is_island(m)]


def _expected(mode, precision) -> str:
    """The arithmetic of a matmul outside islands and fp8's Linears, in `mode`."""
    low = mode.low_dtype
    if low is None:
        on_gpu = precision.device.type == "cuda"
        return "tf32" if mode.tf32 and on_gpu else "fp32"
    if low in precision.fast_kernels.dtypes:
        return "fp32"  # precision.cpu_kernels=fast: computed in fp32 from the low dtype's inputs
    return short(low)


# How much precision an arithmetic keeps: below the plan's is a break of it; above it (PyTorch's
# CPU attention computes bf16 in fp32) costs speed only, and is noted.
_RANK = {"nvfp4": -1, "mxfp4": -1, "fp8": 0, "mxfp8": 0, "bf16": 1, "fp16": 1, "tf32": 2, "fp32": 3}


def _linear_like(kind: str) -> bool:
    return "Linear" in kind or kind == "Conv1D"


def _held(ran: str, planned: str) -> bool | None:
    """True where `ran` is the plan's arithmetic, None above it, False below it or beside it."""
    if ran == planned:
        return True
    return None if _RANK.get(ran, -1) > _RANK.get(planned, 9) else False


def _stage_check(stage: dict, plan: Plan) -> tuple[list[str], list[str]]:
    """(mismatches, notes) of one audited step against the plan of its mode."""
    precision, mode = plan.precision, mode_of(stage["mode"])
    islands = plan.islands()
    fp8 = precision.fp8 if mode.fp8 else None
    skipped = fp8.skipped if fp8 else {}
    expected = _expected(mode, precision)
    island_arithmetic = "tf32" if mode.tf32 and precision.device.type == "cuda" else "fp32"
    mismatches: list[str] = []
    notes: list[str] = []
    for r in stage["ops"]:
        name, ran = r["module"], r["format"]
        where = f"{name or 'the model'}'s {r['direction'].replace('_', ' ')} ({r['op']})"
        island = next((i for i in islands if name == i or name.startswith(f"{i}.")), None)
        if island is not None:
            why = f"the plan keeps {island} in fp32"
            planned = island_arithmetic
        elif fp8 and _linear_like(r["class"]) and name not in skipped:
            why = f"the plan converts {name} to {mode.name}"
            # the weight's gradient may be high precision (rowwise_with_gw_hp): fp8 or above
            planned = mode.compute if r["direction"] != WEIGHT_GRAD else None
        elif fp8 and _linear_like(r["class"]):
            why = f"the plan leaves {name} out of {mode.name} ({skipped[name]})"
            planned = expected
        else:
            why = f"precision={mode.name} computes its matmuls in {expected}"
            planned = expected
        if planned is None:
            continue
        held = _held(ran, planned)
        if held is None and planned == mode.compute and mode.fp8:
            held = False  # a converted Linear that computes above fp8 was not converted
        if held is False:
            mismatches.append(f"{why}; {where} ran in {ran}")
        elif held is None:
            notes.append(f"{where} ran in {ran}, above the plan's {planned}")
        if r["direction"] == WEIGHT_GRAD and name in plan.frozen_modules:
            notes.append(f"{where} computes a gradient for frozen weights: FLOPs spent for nothing")
        if island is not None and held is not False and r["inputs"] != ["fp32"]:
            mismatches.append(f"{why}; {where} took {'/'.join(r['inputs'])} inputs")
    return mismatches, notes


EVALUATION = "the fp32 evaluation (runner.eval_precisions)"


def _evaluation_mismatches(recorded: dict) -> list[str]:
    """The fp32 row of runner.eval_precisions computes in fp32 only: every matmul, and every
    module's output (norm layers included)."""
    out = []
    for r in recorded["ops"]:
        if r["format"] != "fp32" or r["inputs"] != ["fp32"]:
            where = f"{r['module'] or 'the model'}'s {r['op']}"
            out.append(
                f"{EVALUATION} computes in fp32; {where} ran in {r['format']} on {'/'.join(r['inputs'])}"
            )
    for name, dtypes in recorded["outputs"].items():
        if set(dtypes) - {"fp32", "fp64"}:
            out.append(
                f"{EVALUATION} computes in fp32; {name or 'the model'} output {'/'.join(dtypes)}"
            )
    return out


def _parameter_mismatches(params: dict[str, dict], plan: Plan) -> list[str]:
    out = []
    for name in sorted(plan.frozen):
        p = params.get(name)
        if p is None:
            out.append(f"the plan freezes {name}; the model no longer has it")
            continue
        if p["trainable"]:
            out.append(f"the plan freezes {name}; it was made trainable")
        if p["changed"]:
            out.append(f"the plan freezes {name}; it changed over the run")
        if p.get("optimizer_state"):
            out.append(f"the plan freezes {name}; it holds optimizer state")
    return out


def build(
    stages: list[dict],
    plan: Plan,
    truth_rows: dict[str, dict] | None,
    evaluation: dict | None = None,
) -> dict:
    """The manifest of the run (its audited steps, one per precision stage; `evaluation`: the
    record of runner.eval_precisions' fp32 row on its first batch), held against the plan:
    `stages` (modules, by_class), `parameters`, `evaluation`, `mismatches`, `notes`,
    `plan_held`."""
    end = digests(plan.model)
    truth_rows = truth_rows or {}
    params = {}
    for name, p in plan.model.named_parameters():
        row = truth_rows.get(name, {})
        params[name] = {
            "trainable": p.requires_grad,
            "changed": name in plan.start and plan.start[name] != end.get(name),
            **{k: row.get(k) for k in ("weights", "grads", "master", "optimizer_state")},
        }
    mismatches, notes = [], []
    for stage in stages:
        broken, above = _stage_check(stage, plan)
        mismatches += broken
        notes += above
    mismatches += _parameter_mismatches(params, plan)
    if evaluation:
        mismatches += _evaluation_mismatches(evaluation)
    mismatches = list(dict.fromkeys(mismatches))
    return {
        "stages": [
            {
                "mode": s["mode"],
                "step": s["step"],
                "modules": _by_module(s["ops"]),
                "by_class": _by_class(s["ops"]),
            }
            for s in stages
        ],
        "parameters": params,
        **(
            {"evaluation": {"fp32": {"modules": _by_module(evaluation["ops"])}}}
            if evaluation
            else {}
        ),
        "mismatches": mismatches,
        "notes": list(dict.fromkeys(notes)),
        "plan_held": not mismatches,
    }


def _by_module(ops: list[dict]) -> dict[str, dict]:
    modules: dict[str, dict] = {}
    for r in ops:
        entry = modules.setdefault(r["module"], {"class": r["class"], "ops": []})
        entry["ops"].append({k: v for k, v in r.items() if k not in ("module", "class")})
    return modules


def _by_class(ops: Iterable[dict]) -> list[dict]:
    """One row per (class, direction, format, inputs): the modules it covers and its FLOPs."""
    rows: dict[tuple, dict] = {}
    total = sum(r["flops"] for r in ops) or 1
    for r in ops:
        key = (r["class"], r["direction"], r["format"], tuple(r["inputs"]))
        row = rows.setdefault(
            key,
            {
                "class": r["class"],
                "direction": r["direction"],
                "format": r["format"],
                "inputs": r["inputs"],
                "modules": set(),
                "flops": 0,
            },
        )
        row["modules"].add(r["module"])
        row["flops"] += r["flops"]
    out = sorted(rows.values(), key=lambda r: -r["flops"])
    for row in out:
        row["modules"] = len(row["modules"])
        row["flop_share"] = row["flops"] / total
    return out


_SHORT_DIRECTIONS = {
    FORWARD: "fwd",
    INPUT_GRAD: "dgrad",
    WEIGHT_GRAD: "wgrad",
    RECOMPUTE: "recompute",
}


def show(stage: dict) -> None:
    """The audited step's matmuls by module class and format: the directions that ran so, the
    operands' formats, how many modules, the share of the step's matmul FLOPs."""
    rows: dict[tuple, dict] = {}
    for r in _by_class(stage["ops"]):
        key = (r["class"], r["format"], tuple(r["inputs"]))
        row = rows.setdefault(key, {"directions": [], "modules": 0, "share": 0.0})
        row["directions"] += [_SHORT_DIRECTIONS.get(d, d) for d in r["direction"].split("+")]
        row["modules"] = max(row["modules"], r["modules"])
        row["share"] += r["flop_share"]
    if not rows:
        return
    header = ["module", "computed in", "inputs", "directions", "n", "FLOPs"]
    lines = [header] + [
        [
            kind,
            ran,
            "/".join(inputs),
            ",".join(dict.fromkeys(row["directions"])),
            str(row["modules"]),
            f"{row['share']:.1%}",
        ]
        for (kind, ran, inputs), row in sorted(rows.items(), key=lambda kv: -kv[1]["share"])
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    console.say(f"precision manifest: {stage['mode']}, the matmuls of step {stage['step']}")
    for line in lines:
        text = "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True))
        console.console.print(f"  {text.rstrip()}", soft_wrap=True, highlight=False, markup=False)


TABLE_COLUMNS = [
    "stage",
    "module",
    "class",
    "op",
    "direction",
    "format",
    "inputs",
    "calls",
    "flops",
]


def table_rows(manifest: dict) -> list[list]:
    """Every matmul of the manifest, one row each, for a tracker's table."""
    return [
        [
            stage["mode"],
            name,
            entry["class"],
            *(o[k] for k in ("op", "direction", "format")),
            "/".join(o["inputs"]),
            o["calls"],
            o["flops"],
        ]
        for stage in manifest["stages"]
        for name, entry in stage["modules"].items()
        for o in entry["ops"]
    ]


def report(manifest: dict, log) -> None:
    """The plan's mismatches as warnings; the manifest as a table for the tracker (`log`: the
    run's RunLog)."""
    for mismatch in manifest["mismatches"]:
        console.say(f"[yellow]warning:[/] precision manifest: {escape(mismatch)}")
    log.log_table("precision_manifest", TABLE_COLUMNS, table_rows(manifest))
