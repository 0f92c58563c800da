"""Each matmul's measured error over a run (runner/measure/matmul_error.py measures one step):
which steps are measured (the audited step of each precision stage, and every
precision.error_every_n_steps steps where asked), the k worst modules printed under the audited
step's manifest, the table in summary.json (`matmul_error`) and as the tracker's table, and the
comparison's "worst layer"."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from runner.errors import UserError
from runner.measure.matmul_error import SHORT, ErrorProbe, show, worst

COLUMNS = ["step", "module", "class", "direction", "format", "sqnr_db", "calls"] + [
    f"{side}_{key}"
    for side in ("a", "b")
    for key in ("operand", "format", "amax", "underflow", "clamp")
]


class MatmulErrors:
    """The run's measurements of each matmul's error, step by step (`records`)."""

    def __init__(self, model: nn.Module, precision):
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

    def around(self, meter, audit: tuple) -> contextlib.AbstractContextManager:
        """The training step's context: `meter.audited(*audit)` (runner/train/telemetry.py), and
        where the step (`audit`'s last) is audited or one of every `every`, the measurement
        inside it, its k worst modules printed under the audited step's manifest; elsewhere the
        audit's context alone, nothing added."""
        step, audited = audit[-1], meter.audit is None
        if not self.enabled:
            return meter.audited(*audit)
        if audited or (self.every and step % self.every == 0):
            return self._measuring(meter.audited(*audit), step, audited)
        return meter.audited(*audit)

    @contextlib.contextmanager
    def _measuring(self, outer: contextlib.AbstractContextManager, step: int, audited: bool):
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
