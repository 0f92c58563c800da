"""The precision manifest: what every matmul of the audited step really ran in, observed at the
dispatcher (the audit's dispatch mode), whatever a mode believes it did, and held against the
plan, what the config asked for.

Per module (its qualified name) and matmul-like op (every op with a FLOP formula: mm, addmm,
bmm, baddbmm, convolution and its backward, scaled-dot-product attention, torchao's fp8 and MX
GEMMs): the direction (forward, gradient of the input, gradient of the weight, a forward that
gradient checkpointing recomputes), its operands' formats and the format it computed in, and its
FLOPs. Per parameter: trainable or not, changed over the run or not (a digest at the start and
at the end), and the dtypes precision truth read off it (weights, gradients, master, optimizer
state). The plan: fp32 islands (and `fp32_head`) compute in fp32 in all directions; a converting
mode (fp8, mxfp8, nvfp4, mxfp4) computes its converted Linears in its format and every other Linear
is listed with its reason; every other matmul computes in the mode's arithmetic (in fp32 where
`cpu_kernels` computes it so); frozen parameters never change and hold no optimizer state. Each
difference is one line; `plan_held` is False where there is one."""

from __future__ import annotations

import torch
from torch import nn

from runner.measure.manifest_table import by_class, by_module
from runner.measure.matmuls import FORWARD, INPUT_GRAD, RECOMPUTE, WEIGHT_GRAD
from runner.measure.memory import local
from runner.measure.truth import short
from runner.precision.fp32_islands import is_island
from runner.precision.modes import mode_of
from runner.precision.recipe import DIRECTIONS


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
    """The arithmetic of a matmul outside islands and converted Linears, in `mode`."""
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


def _by_rule(
    converted, name: str, direction: str, mode, expected: str, step: int
) -> tuple[str | None, str]:
    """(planned, why) for a direction of a converted Linear at optimizer step `step`: its
    recipe rule's format (a rule's bf16 is autocast's arithmetic here: `expected`; the autopilot's
    switches change the plan from their step on), the forward's for a recomputed forward."""
    formats, rule = converted.plan_at(step).get(name), converted.rule_of.get(name)
    if formats is None:  # converted by other means than the chooser (a test's)
        return (mode.compute if direction != WEIGHT_GRAD else None), f"the plan converts {name}"
    index = {FORWARD: 0, RECOMPUTE: 0, INPUT_GRAD: 1, WEIGHT_GRAD: 2}.get(direction)
    if index is None:
        return None, ""
    fmt = formats[index]
    planned = mode.compute if fmt not in ("bf16", "fp32") else expected if fmt == "bf16" else fmt
    source = rule.source if rule else "the plan"
    if fmt in ("bf16", "fp32"):
        return planned, f"{source} keeps {name}'s {DIRECTIONS[index]} in {fmt}"
    by = "" if source.endswith("'s default") else f" ({source})"
    return planned, f"the plan converts {name} to {mode.name}{by}"


def _left_out(converted, name: str, mode, expected: str) -> tuple[str, str]:
    """(planned, why) for a Linear the plan leaves out: autocast's arithmetic, or fp32 where its
    rule keeps every direction fp32 (it is then an fp32 island, held as one above, unless it was
    not made one)."""
    rule = converted.rule_of.get(name)
    if rule is not None and rule.island():
        return "fp32", f"{rule.source} keeps {name} in fp32 (an fp32 island)"
    return expected, f"the plan leaves {name} out of {mode.name} ({converted.skipped[name]})"


def _stage_check(stage: dict, plan: Plan) -> tuple[list[str], list[str]]:
    """(mismatches, notes) of one audited step against the plan of its mode."""
    precision, mode = plan.precision, mode_of(stage["mode"])
    islands = plan.islands()
    converted = precision.converted if mode.converts else None
    skipped = converted.skipped if converted else {}
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
        elif converted and _linear_like(r["class"]) and name not in skipped:
            planned, why = _by_rule(converted, name, r["direction"], mode, expected, stage["step"])
        elif converted and _linear_like(r["class"]):
            planned, why = _left_out(converted, name, mode, expected)
        else:
            why = f"precision={mode.name} computes its matmuls in {expected}"
            planned = expected
        if planned is None:
            continue
        held = _held(ran, planned)
        if held is None and planned == mode.compute and mode.converts:
            held = False  # a converted Linear that computes above its format was not converted
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
                "modules": by_module(s["ops"]),
                "by_class": by_class(s["ops"]),
            }
            for s in stages
        ],
        "parameters": params,
        **(
            {"evaluation": {"fp32": {"modules": by_module(evaluation["ops"])}}}
            if evaluation
            else {}
        ),
        "mismatches": mismatches,
        "notes": list(dict.fromkeys(notes)),
        "plan_held": not mismatches,
    }
