"""Each matmul's measured error over a run (runner/measure/matmul_error.py measures one step):
which steps are measured (the audited step of each precision stage, and every
precision.error_every_n_steps steps where asked), the k worst modules printed under the audited
step's manifest, the table in summary.json (`matmul_error`) and as the tracker's table, and the
comparison's "worst layer"."""

from __future__ import annotations

import contextlib
import math
import time

import torch
from torch import nn

from runner import console
from runner.errors import UserError
from runner.measure.matmul_error import ErrorProbe
from runner.measure.matmuls import FORWARD, INPUT_GRAD, WEIGHT_GRAD

WORST_SHOWN = 3  # modules printed after the audited step's manifest
SHORT = {FORWARD: "fwd", INPUT_GRAD: "dgrad", WEIGHT_GRAD: "wgrad"}

COLUMNS = ["step", "module", "class", "direction", "format", "sqnr_db", "calls"] + [
    f"{side}_{key}"
    for side in ("a", "b")
    for key in ("operand", "format", "amax", "underflow", "clamp")
]


class MatmulErrors:
    """The run's measurements of each matmul's error, step by step (`records`)."""

    def __init__(self, model: nn.Module, precision, trainer_cfg=None):
        every = getattr(precision.cfg, "error_every_n_steps", 0) or 0
        if not isinstance(every, int) or every < 0:
            raise UserError(
                f"precision.error_every_n_steps={every!r} is invalid: a whole number of steps "
                "(0: the audited step only)"
            )
        self.model, self.precision, self.every = model, precision, every
        self.records: list[dict] = []
        # precision.matmul_error, read once; a throwaway trainer's (runner/train/session.py) never
        self.enabled = bool(getattr(precision.cfg, "matmul_error", False))
        # precision.autopilot: measures on its own steps, and moves units to bf16 from the next
        self.autopilot = getattr(precision, "autopilot", None)
        self.trainer_cfg = trainer_cfg  # its max_steps, for the autopilot's final phase
        self.piloted = [0, 0.0]  # the autopilot's measured steps: how many, their seconds

    def around(self, meter, audit: tuple) -> contextlib.AbstractContextManager:
        """The training step's context: `meter.audited(*audit)` (runner/train/telemetry.py), and
        where the step (`audit`'s last) is audited or one of every `every`, the measurement
        inside it, its k worst modules printed under the audited step's manifest; elsewhere the
        audit's context alone, nothing added."""
        step, piloted = audit[-1], False
        if self.autopilot is not None:
            max_steps = self.trainer_cfg.max_steps
            if self.autopilot.at_step(step, max_steps):  # its final phase: all bf16 from here
                meter.restage()  # this step's manifest shows it
            piloted = self.autopilot.due(step, max_steps)
        audited = meter.audit is None
        if not (self.enabled or piloted):
            return meter.audited(*audit)
        if audited or piloted or (self.every and step % self.every == 0):
            return self._measuring(meter, audit, piloted)
        return meter.audited(*audit)

    @contextlib.contextmanager
    def _measuring(self, meter, audit: tuple, piloted: bool):
        """The step measured; where the autopilot measures it (`piloted`), its switches made
        for the next step, which is audited (its manifest shows them)."""
        step, audited, outer = audit[-1], meter.audit is None, meter.audited(*audit)
        started = time.perf_counter()
        linears = self.precision.converted
        converted = bool(linears and linears.active)
        fast = frozenset(self.precision.fast_kernels.dtypes)
        probe = ErrorProbe(self.model, step, converted, fast)
        with outer:
            with torch.compiler.set_stance("force_eager"), probe:  # hooks: eagerly, as the audit
                yield
            records = probe.records()
            self.records += records
        if audited:
            show(records, step)
        if piloted:
            self.piloted[0] += 1
            self.piloted[1] += time.perf_counter() - started
            if self.autopilot.measured(records, step):
                meter.restage()

    def report(self, log) -> dict:
        """summary.json's `matmul_error`; the same table for the tracker (`log`: the RunLog)."""
        if not self.records:
            return {}
        log.log_table("matmul_error", COLUMNS, table_rows(self.records))
        return {"matmul_error": self.records}


def table_rows(records: list[dict]) -> list[list]:
    rows = []
    for r in records:
        row = [r[k] for k in COLUMNS[:7]]
        for role, o in r["operands"].items():
            row += [role, o["format"], o["amax"], o["underflow"], o["clamp"]]
        rows.append(row + [None] * (len(COLUMNS) - len(row)))
    return rows


def worst_layer(summaries: list[dict]) -> str | None:
    """The comparison's "worst layer": the module and direction with the lowest SQNR any of the
    summaries measured, and that SQNR; None where none measured one."""
    records = [
        r
        for s in summaries
        for r in (s.get("matmul_error") or [])
        if isinstance(r.get("sqnr_db"), int | float) or r.get("sqnr_db") == "inf"
    ]
    if not records:
        return None
    records = [r | {"sqnr_db": float(r["sqnr_db"])} for r in records]
    r = worst(records, 1)[0]
    if r["sqnr_db"] == math.inf:
        return "no error"
    return f"{r['module']} {SHORT.get(r['direction'], r['direction'])} {r['sqnr_db']:.1f} dB"


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
