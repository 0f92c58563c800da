"""precision.autopilot: each converted Linear's format chosen during the run from its measured
error. Every `every_n_steps` steps the matmul-error probe (runner/measure/matmul_error.py)
measures each unit (one Linear's direction; MXFP8's forward and input gradient together, which
torchao switches only together); a unit whose measurement says its format no longer holds it
moves to bf16 from the next step for the rest of the run, as if the recipe had said so from that
step (`ConvertedLinears.switch`): its SQNR under the floor for its format, an operand's share
flushed to zero over the ceiling, or its SQNR fallen more than a margin below the median of its
own earlier measurements. Under several ranks every rank decides on the same figures (each
unit's lowest SQNR and highest flushed share over the ranks), so all switch the same units at
the same step. `final_bf16`: every unit moves to bf16 for the run's last share of steps.

Its keys and their defaults: runner/config/autopilot.py (below what clean runs of each format
reach: scripts/autopilot_ranges.py; the figures in docs/precision-modes.md)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runner import console
from runner.errors import UserError
from runner.precision.recipe import DIRECTIONS, HIGH

KEY = "precision.autopilot"
MIN_EARLIER = 2  # earlier measurements a unit needs before its fall is judged
FINAL = "every unit left"  # a final_bf16 switch's `measured`: no measurement decided it


@dataclass(frozen=True)
class Switch:
    """A unit moved to bf16: from optimizer `step` on, `module`'s `directions`."""

    step: int
    module: str
    directions: tuple[str, ...]
    measured: str  # what was measured, e.g. "SQNR 0.4 dB"
    crossed: str  # the threshold it crossed, with its key

    def line(self) -> str:
        return (
            f"autopilot: step {self.step}: {self.module} {'+'.join(self.directions)} → bf16: "
            f"{self.measured}, {self.crossed}"
        )


def for_run(cfg, mode_name: str, converted, device: torch.device) -> Autopilot | None:
    """The run's autopilot (`cfg`: the precision group), None where it is off; its values and
    the mode it needs checked first."""
    pilot = getattr(cfg, "autopilot", None)  # a session's own precision config has none
    if pilot is None or not pilot.enabled:
        return None
    check(pilot, mode_name, converted is not None)
    return Autopilot(pilot, converted, device)


def state(autopilot: Autopilot | None) -> dict | None:
    """What a checkpoint keeps of the run's autopilot (None where it is off)."""
    return autopilot.state_dict() if autopilot is not None else None


def resume(autopilot: Autopilot | None, state: dict | None) -> None:
    """A checkpoint's switches made again; where the autopilot is off now, said, not made."""
    if autopilot is not None:
        autopilot.load_state_dict(state)
    elif state and state.get("switches"):
        console.say(
            f"[yellow]warning:[/] the checkpoint's run moved {len(state['switches'])} unit(s) to "
            f"bf16 with {KEY}; it is off now: they run in the mode's format again "
            f"(the recipe it wrote, or {KEY}=true, keeps them)"
        )


def check(cfg, mode_name: str, converting: bool) -> None:
    """precision.autopilot's values, and the mode it needs: one line for a bad one."""
    if not cfg.enabled:
        return
    if not converting:
        raise UserError(
            f"{KEY}.enabled=true is invalid with precision={mode_name}: the autopilot moves a "
            "converting mode's Linears to bf16 (allowed: fp8, mxfp8, nvfp4, mxfp4)"
        )
    if not isinstance(cfg.every_n_steps, int) or cfg.every_n_steps < 1:
        raise UserError(f"{KEY}.every_n_steps={cfg.every_n_steps!r} is invalid: a whole number ≥ 1")
    if not 0 <= cfg.final_bf16 < 1:
        raise UserError(
            f"{KEY}.final_bf16={cfg.final_bf16!r} is invalid: a share of the steps in [0, 1)"
        )
    if not cfg.sqnr_drop_db >= 0:  # a NaN too: it would switch nothing, silently
        raise UserError(f"{KEY}.sqnr_drop_db={cfg.sqnr_drop_db!r} is invalid: a margin in dB ≥ 0")
    for fmt, floor in cfg.sqnr_floor_db.items():
        if math.isnan(floor):
            raise UserError(f"{KEY}.sqnr_floor_db.{fmt}={floor!r} is invalid: a number of dB")
    for fmt, ceiling in cfg.flushed_ceiling.items():
        if not 0 < ceiling <= 1:
            raise UserError(
                f"{KEY}.flushed_ceiling.{fmt}={ceiling!r} is invalid: a share in (0, 1]"
            )


class Autopilot:
    """The run's units, their measurements so far (`history`), and the switches made."""

    def __init__(self, cfg, converted, device: torch.device):
        self.cfg, self.converted, self.device = cfg, converted, device
        self.format = converted.compute
        self.floor = float(cfg.sqnr_floor_db.get(self.format, -math.inf))
        self.ceiling = float(cfg.flushed_ceiling.get(self.format, 1.0))
        self.switches: list[Switch] = []
        self.history: dict[str, list[float]] = {}  # unit → its SQNRs, step by step

    def final_step(self, max_steps: int) -> int:
        """The first step of the final phase (final_bf16): max_steps + 1 where there is none."""
        return max_steps - int(round(self.cfg.final_bf16 * max_steps)) + 1

    def due(self, step: int, max_steps: int) -> bool:
        """Whether optimizer step `step` (1-based) is measured for the autopilot."""
        # the run's last step too: its switches are in the checkpoint, for a resume that goes on
        # (a run stopped there by a shorter max_steps then continues as the uninterrupted one)
        return step % self.cfg.every_n_steps == 0 and step < self.final_step(max_steps)

    def units(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        """Each unit still in the format: its name → (module, its directions)."""
        out = {}
        for name, formats in sorted(self.converted.plan.items()):
            low = tuple(d for d, f in zip(DIRECTIONS, formats, strict=True) if f not in HIGH)
            groups = [low[:2], low[2:]] if self.format == "mxfp8" else [(d,) for d in low]
            for dirs in (g for g in groups if g):
                out[f"{name} {'+'.join(dirs)}"] = (name, dirs)
        return out

    def measured(self, records: list[dict], step: int) -> list[Switch]:
        """After measured step `step`: the units whose measurement crossed a threshold, moved to
        bf16 from step + 1 (said in a line each)."""
        units = self.units()
        sqnr, flushed = _shared(_figures(records, units), self.device)
        made = []
        for unit, (name, dirs) in units.items():
            crossed = self._crossed(unit, sqnr[unit], flushed[unit])
            if sqnr[unit] is not None and math.isfinite(sqnr[unit]):
                self.history.setdefault(unit, []).append(sqnr[unit])
            if crossed:
                made.append(Switch(step + 1, name, dirs, *crossed))
        self._apply(made)
        return made

    def _crossed(self, unit: str, sqnr: float | None, flushed: float) -> tuple[str, str] | None:
        """(measured, threshold) where the unit's measurement crosses one, else None."""
        if sqnr is None or sqnr == math.inf:  # not measured (an unused Linear), or exact
            return None
        said = f"SQNR {sqnr:.1f} dB"
        if sqnr < self.floor:
            return said, f"under the floor {self.floor:g} dB ({KEY}.sqnr_floor_db.{self.format})"
        if flushed > self.ceiling:
            return (
                f"{flushed:.1%} of an operand flushed to zero",
                f"over the ceiling {self.ceiling:.0%} ({KEY}.flushed_ceiling.{self.format})",
            )
        earlier = self.history.get(unit, [])
        if len(earlier) >= MIN_EARLIER:
            median = statistics.median(earlier)
            if median - sqnr > self.cfg.sqnr_drop_db:
                return (
                    f"{said}, {median - sqnr:.1f} dB below its own median {median:.1f} dB",
                    f"over the margin {self.cfg.sqnr_drop_db:g} dB ({KEY}.sqnr_drop_db)",
                )
        return None

    def at_step(self, step: int, max_steps: int) -> list[Switch]:
        """Before optimizer step `step` (1-based): the final phase's switch of every unit left,
        at its first step."""
        if step != self.final_step(max_steps) or self.cfg.final_bf16 <= 0:
            return []
        share = f"the last {self.cfg.final_bf16:.0%} of the steps ({KEY}.final_bf16)"
        made = [Switch(step, name, dirs, FINAL, share) for name, dirs in self.units().values()]
        self._apply(made)
        return made

    def _apply(self, switches: list[Switch], say: bool = True) -> None:
        """Each switch made on its Linear: its directions bf16 (MXFP8's forward and input
        gradient take the weight gradient with them: torchao keeps only that one high alone)."""
        for s in switches:
            high = set(s.directions)
            if self.format == "mxfp8" and "forward" in high:
                high = set(DIRECTIONS)
            formats = zip(DIRECTIONS, self.converted.plan[s.module], strict=True)
            new = tuple("bf16" if d in high else f for d, f in formats)
            self.converted.switch(s.module, new, s.step, f"the autopilot from step {s.step}")
            if say:
                console.say(s.line())
        self.switches += switches

    def state_dict(self) -> dict:
        return {
            "switches": [s.__dict__ | {"directions": list(s.directions)} for s in self.switches],
            "history": self.history,
        }

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's switches made again, its measurements kept: the run goes on as if
        never stopped."""
        if not state:
            return
        self.history = {k: list(v) for k, v in state["history"].items()}
        switches = [Switch(**s | {"directions": tuple(s["directions"])}) for s in state["switches"]]
        self._apply(switches, say=False)


def _figures(records: list[dict], units: dict) -> tuple[dict, dict]:
    """Per unit: its lowest SQNR over its directions (None where none was measured), and the
    highest share of an operand flushed to zero."""
    by = {(r["module"], r["direction"]): r for r in records}
    sqnr, flushed = {}, {}
    for unit, (name, dirs) in units.items():
        found = [by[(name, d)] for d in dirs if (name, d) in by]
        # a NaN SQNR (the format's product not finite) is the worst there is
        values = [float(r["sqnr_db"]) for r in found if r["sqnr_db"] is not None]
        values = [-math.inf if math.isnan(v) else v for v in values]
        sqnr[unit] = min(values) if values else None
        flushed[unit] = max(
            (o["underflow"] for r in found for o in r["operands"].values()), default=0.0
        )
    return sqnr, flushed


def _shared(figures: tuple[dict, dict], device: torch.device) -> tuple[dict, dict]:
    """Every rank's figures made one: each unit's lowest SQNR and highest flushed share over the
    ranks (one all-reduce), so every rank decides the same."""
    sqnr, flushed = figures
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return sqnr, flushed
    units = list(sqnr)
    missing = math.inf  # a rank that did not measure a unit does not lower it
    values = [-(sqnr[u] if sqnr[u] is not None else missing) for u in units]
    values += [flushed[u] for u in units]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    low = [-v for v in t[: len(units)].tolist()]
    return (
        {u: (v if v != missing else None) for u, v in zip(units, low, strict=True)},
        dict(zip(units, t[len(units) :].tolist(), strict=True)),
    )
