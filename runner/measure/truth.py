"""Precision truth: the dtypes a run really holds, read off its tensors once, after the first
optimizer step (the optimizer state exists then), and set against what the config asked for.

One row per distinct combination (module kind, the part of a fine-tune it is in, weights,
gradients, fp16_master's master copy and its gradients, optimizer state, autocast, FSDP's gather
dtype, the gradient reduce dtype), with a count and an example name. Printed at the start of
the run, mismatches as warnings, and written to summary.json as
`precision_truth: {mode, autocast, rows, mismatches}`."""

from __future__ import annotations

import torch
from rich.markup import escape

from runner import console
from runner.measure.memory import local
from runner.precision.adapters import adapter_parameters
from runner.precision.fp32_islands import is_island
from runner.precision.modes import mode_of
from runner.precision.norms import norm_layers
from runner.precision.reduce import bf16_average


def short(dtype: torch.dtype | None) -> str | None:
    names = {None: None, torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def held(t: torch.Tensor | None) -> str | None:
    """The dtype a tensor holds (an FSDP2 shard's own)."""
    return None if t is None else short(local(t).dtype)


class Quantized(str):
    """A quantized optimizer state tensor (torchao's 8-bit state: a tensor subclass that shows the
    dtype it dequantizes to) by the parts it holds: `uint8 codes, fp32 scale, fp32 qmap`. Its
    format is the optimizer's own (optim=adamw8bit), not a dtype the config names."""


def _state_held(t: torch.Tensor) -> str:
    t = local(t)
    if not hasattr(t, "__tensor_flatten__"):
        return held(t)
    return Quantized(", ".join(f"{held(getattr(t, n))} {n}" for n in t.__tensor_flatten__()[0]))


class Truth(dict):
    """The table, as a plain dict in summary.json; one line in the final summary table. Its
    `parameters`: each parameter's row by name (the precision manifest's, not in the table)."""

    parameters: dict[str, dict]

    def __repr__(self) -> str:
        return f"{len(self['rows'])} rows, {len(self['mismatches'])} mismatches (see run start)"


def watch(
    optimizers: dict,
    task: torch.nn.Module,
    model,
    precision,
    state_dtype: str | None,
    summary: dict,
) -> None:
    """After the last optimizer's first applied step (all have stepped then): print the table
    and put it in `summary`. The hook removes itself."""

    def once(*_) -> None:
        handle.remove()
        truth = precision_truth(task, model, precision, list(optimizers.values()), state_dtype)
        summary["precision_truth"] = truth
        show(truth)

    handle = list(optimizers.values())[-1].register_step_post_hook(once)


def _fsdp_policies(task: torch.nn.Module) -> dict:
    """id(sharded parameter) → the MixedPrecisionPolicy its FSDP unit gathers and reduces with."""
    from torch.distributed.fsdp import FSDPModule

    found = {}
    for module in task.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                found |= {id(fp.sharded_param): group.mp_policy for fp in group.fsdp_params}
    return found


def _kind(module: torch.nn.Module) -> str:
    """The module's class, as written (FSDP2 subclasses it as `FSDP<Name>`)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__


def _reduce(model, precision, policy, grad: str, stand_in: torch.Tensor) -> str | None:
    """The dtype a gradient is averaged over ranks in (None: one process)."""
    if policy is not None:  # FSDP: reduce_dtype, or the gathered dtype the grads come in
        return short(policy.reduce_dtype or policy.param_dtype) or grad
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        hooks = [hook for hook, _ in model._comm_hooks]
        if not hooks:
            return grad  # DDP's buckets all-reduce in the gradients' dtype
        return "bf16" if hooks[-1] is bf16_average else hooks[-1].__name__
    if precision.master and precision.world > 1:
        # fp16_master averages the fp32 gradients itself, sent in bf16 where asked
        return "bf16" if precision.cfg.reduce_dtype == "bf16" else held(stand_in)
    return None


def precision_truth(task, model, precision, optimizers, state_dtype: str | None = None) -> Truth:
    """The table, read off `task`'s parameters, their gradients, masters and optimizer state;
    `state_dtype` is `optim.state_dtype` (null: the state is in the stepped weights' dtype)."""
    state = {p: s for opt in optimizers for p, s in opt.state.items()}
    policies = _fsdp_policies(task) if precision.sharded else {}
    modules = dict(task.named_modules())
    norms = norm_layers(task, precision.cfg.norm_modules)  # the rule the casts follow
    islands = {p for m in modules.values() if is_island(m) for p in m.parameters()}  # and tied
    autocast = short(precision.dtype) or "off"
    adapters = adapter_parameters(task)
    rows: dict[str, dict] = {}
    per_parameter: dict[str, dict] = {}
    for name, p in task.named_parameters():  # tied weights once
        module = modules[name.rpartition(".")[0]]
        master = precision.master.masters.get(p)
        stand_in = p if master is None else master
        weights = held(p)
        grad = held(p.grad) or weights  # fp16_master moved it into the master's
        policy = policies.get(id(p))
        opt_state = {
            k: _state_held(v)
            for k, v in state.get(stand_in, {}).items()
            if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point()
        }
        trains = p.requires_grad
        row = {
            "module": _kind(module),
            # a fine-tune's parts: its adapters (model.peft) and what gets no gradient
            "part": "adapter" if p in adapters else None if trains else "frozen",
            "weights": weights,
            "grads": grad if trains else None,
            "master": held(master),
            "master_grads": held(getattr(master, "grad", None)),
            "optimizer_state": opt_state or None,
            "autocast": "off (island)" if p in islands else autocast,
            "gather": (short(policy.param_dtype) or weights) if policy else None,
            "reduce": _reduce(model, precision, policy, grad, stand_in) if trains else None,
            "norm": module in norms,
        }
        per_parameter[name] = row
        key = repr(sorted(row.items()))
        rows.setdefault(key, {"count": 0, "example": name, **row})["count"] += 1
    found = list(rows.values())
    problems: dict[str, list[dict]] = {}  # one line a problem, however many rows show it
    for row in found:
        for problem in _problems(row, precision, state_dtype):
            problems.setdefault(problem, []).append(row)
    mismatches = [
        f"{problem}: {sum(r['count'] for r in hit)} parameter(s) of "
        f"{', '.join(dict.fromkeys(r['module'] for r in hit))} (e.g. {hit[0]['example']})"
        for problem, hit in problems.items()
    ]
    truth = Truth(mode=precision.mode, autocast=autocast, rows=found, mismatches=mismatches)
    truth.parameters = per_parameter
    return truth


def _problems(row: dict, precision, state_dtype: str | None) -> list[str]:
    """What the row holds that `precision` and `optim.state_dtype` did not ask for."""
    mode, out = mode_of(precision.mode), []
    island = row["autocast"] == "off (island)"
    expected, why = mode.expects(precision.cfg, row)
    if row["weights"] != expected:
        out.append(f"weights are {row['weights']}, but {why}")
    if mode.masters and row["grads"] == mode.weights and row["master"] != "fp32":
        out.append(f"master copy is {row['master']}, not fp32")
    if row["master_grads"] not in (None, "fp32"):
        out.append(f"master gradients are {row['master_grads']}, not fp32")
    stepped = "fp32" if mode.masters else expected  # what the optimizer steps
    for key, dtype in (row["optimizer_state"] or {}).items():
        # optim.state_dtype sets the moments; kahan's compensation is in the weight's dtype
        state = state_dtype if state_dtype and key != "compensation" else stepped
        if dtype != state and not isinstance(dtype, Quantized):
            out.append(f"optimizer state {key} is {dtype}, not {state}")
    if row["gather"] and row["gather"] not in {row["weights"], None if island else row["autocast"]}:
        out.append(f"FSDP gathers them in {row['gather']}, under autocast {row['autocast']}")
    asked = precision.cfg.reduce_dtype
    if row["reduce"] and row["reduce"] != asked:
        out.append(f"gradients are reduced in {row['reduce']}, not {asked} as asked")
    return out


COLUMNS = (
    ("module", "module"),
    ("part", "part"),
    ("count", "n"),
    ("weights", "weights"),
    ("grads", "grads"),
    ("master", "master"),
    ("master_grads", "master grads"),
    ("optimizer_state", "optimizer state"),
    ("autocast", "autocast"),
    ("gather", "FSDP gather"),
    ("reduce", "reduce"),
    ("example", "e.g."),
)


def _cell(value) -> str:
    """Optimizer state: one dtype where its tensors agree (summary.json names each one)."""
    if isinstance(value, dict):
        dtypes = set(value.values())
        return dtypes.pop() if len(dtypes) == 1 else ", ".join(f"{k} {v}" for k, v in value.items())
    return "-" if value is None else str(value)


def show(truth: Truth) -> None:
    """Plain aligned columns (those that hold nothing in this run left out), the example last and
    whole, then one warning a mismatch. Lines are not wrapped: a log keeps them whole."""
    shown = [(k, h) for k, h in COLUMNS if any(r[k] is not None for r in truth["rows"])]
    lines = [[h for _, h in shown], *([_cell(r[k]) for k, _ in shown] for r in truth["rows"])]
    widths = [max(len(line[i]) for line in lines) for i in range(len(shown))]
    console.say(f"precision truth: {truth['mode']}, after the first optimizer step")
    for line in lines:
        text = "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True))
        console.console.print(f"  {text.rstrip()}", soft_wrap=True, highlight=False, markup=False)
    for mismatch in truth["mismatches"]:
        console.say(f"[yellow]warning:[/] precision truth: {escape(mismatch)}")
