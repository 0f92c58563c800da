"""The recipe search's units and their ranking (runner/answers/recipe_search.py).

A unit is what the mode can keep in bf16 on its own: a Linear's forward, input_grad or
weight_grad; under mxfp8 its `weight_grad` and its `forward+input_grad` (torchao's MXFP8Linear
keeps weight_grad alone in high precision, as its wgrad_with_hp recipe does, but computes forward
and input_grad in one format: keeping those two in bf16 keeps the module unconverted, all three
directions, and so its rule says).

The units that computed in the format are ranked on candidate 0's measurements at several steps
(matmul_error): each unit's SQNR is its mean over the steps measured (at each step a unit's worse
direction), with its spread (their standard deviation); lowest mean first, then the larger mean
share of an operand flushed to zero. Neighbours whose means differ by less than the larger of
their spreads are tied: the measurements cannot order them (`tie`, a number shared by a run of
such neighbours)."""

from __future__ import annotations

import math
import statistics

from runner.precision.recipe import DIRECTIONS

FUSED = "forward+input_grad"  # mxfp8's unit of forward and input_grad


def unit_of(direction: str, compute: str) -> str:
    return FUSED if compute == "mxfp8" and direction in DIRECTIONS[:2] else direction


def kept(unit: dict) -> tuple[str, ...]:
    """The directions a unit's rule keeps in bf16: all three for mxfp8's forward+input_grad."""
    return DIRECTIONS if unit["direction"] == FUSED else (unit["direction"],)


def _sqnr(value) -> float:
    if not isinstance(value, int | float):
        return math.inf  # None: no signal
    return -math.inf if math.isnan(value) else float(value)  # a non-finite product: worst


def _flushed(record: dict) -> float:
    return max((o["underflow"] for o in record["operands"].values()), default=0.0)


def _centre(values: list[float]) -> tuple[float, float]:
    """(mean, spread) of a unit's SQNRs over the steps: -inf where one is, the finite ones'
    otherwise (inf where none is: no signal at any step)."""
    finite = [v for v in values if math.isfinite(v)]
    if -math.inf in values or not finite:
        return (-math.inf if -math.inf in values else math.inf), 0.0
    return statistics.fmean(finite), statistics.pstdev(finite)


def rank(records: list[dict], compute: str) -> list[dict]:
    """The units that computed in `compute`, worst first, each with its SQNR's mean (`sqnr_db`),
    spread (`sqnr_spread_db`) and range over the `steps` measured, its mean flushed share, and
    `tie` (None: told apart from its neighbours)."""
    per: dict[tuple[str, str], dict[int, tuple[float, float]]] = {}
    for r in records:
        if r["format"] != compute:
            continue
        steps = per.setdefault((r["module"], unit_of(r["direction"], compute)), {})
        value = (_sqnr(r["sqnr_db"]), _flushed(r))
        held = steps.get(r["step"])
        if held is None or (value[0], -value[1]) < (held[0], -held[1]):
            steps[r["step"]] = value  # at each step, the unit's worse direction
    units = []
    for (module, direction), steps in per.items():
        values = [v for v, _ in steps.values()]
        mean, spread = _centre(values)
        units.append(
            {
                "module": module,
                "direction": direction,
                "sqnr_db": mean,
                "sqnr_spread_db": spread,
                "sqnr_range_db": [min(values), max(values)],
                "steps": sorted(steps),
                "underflow": statistics.fmean(u for _, u in steps.values()),
            }
        )
    units.sort(key=lambda u: (u["sqnr_db"], -u["underflow"]))
    _ties(units)
    return units


def _ties(units: list[dict]) -> None:
    """Each unit's `tie`: the number of its run of neighbours no measured difference orders."""
    tie, previous = 0, None
    for u in units:
        u["tie"] = None
        if previous is not None and _tied(previous, u):
            if previous["tie"] is None:
                tie += 1
                previous["tie"] = tie
            u["tie"] = tie
        previous = u


def _tied(a: dict, b: dict) -> bool:
    if not (math.isfinite(a["sqnr_db"]) and math.isfinite(b["sqnr_db"])):
        return False
    return abs(a["sqnr_db"] - b["sqnr_db"]) < max(a["sqnr_spread_db"], b["sqnr_spread_db"])


def ladder(ranked: list[dict]) -> list[dict]:
    """The units candidates add, in the ranking's order: those an earlier one does not already
    keep (mxfp8's weight_grad of a module whose forward+input_grad ranks before it)."""
    held: set[tuple[str, str]] = set()
    out = []
    for u in ranked:
        if (u["module"], u["direction"]) in held:
            continue
        held |= {(u["module"], d) for d in kept(u)}
        out.append(u)
    return out


def rules(units: list[dict]) -> list[dict]:
    """The recipe's rules keeping `units` in bf16: one per module, in the ranking's order."""
    out: dict[str, dict] = {}
    for u in units:
        rule = out.setdefault(u["module"], {"module": u["module"]})
        rule |= dict.fromkeys(kept(u), "bf16")
    return list(out.values())
