"""Where a run's wall time went (summary.json's `wall_time`): startup (the imports, where the run
is the first of a `python -m runner` process; the answers found before training; the model, data
and precision built), the audited step (the precision manifest, each matmul's error), the other
warm-up steps, the steady steps, evaluation, checkpoints, logging (each interval's rows
written), and teardown (the measurements after training, the final evaluations, the manifest,
the summary). The phases are timed one by one and add up to the total, from the process's start
(or the call of `run`) to the summary's last figure; writing it, and the tracker's finish (W&B
syncing an offline run's files), come after."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

# Where a fit's wall time goes, timed by its Meter (runner/train/telemetry.py)
FIT_PHASES = ("audited_step", "warmup_steps", "steady_steps", "evaluation", "checkpoints")
_imports_counted = False  # the process's imports go to its first run only


def _process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), None elsewhere."""
    try:
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))


def _imports_s() -> float:
    """Where this is the first run of a `python -m runner` process: the time since the process
    started (the interpreter, the imports, Hydra composing the config); else 0 (a run called
    from Python starts when it is called)."""
    global _imports_counted
    first, _imports_counted = not _imports_counted, True
    entry = Path(sys.argv[0]).parts[-2:] if sys.argv and sys.argv[0] else ()
    if not first or tuple(entry) != ("runner", "__main__.py"):
        return 0.0
    return _process_age() or 0.0


class Phases:
    """A fit's seconds by phase (FIT_PHASES): each logging interval's steps, warm-up or steady,
    less the audited step timed inside it; evaluation and checkpoints."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys(FIT_PHASES, 0.0)
        self._audit_s = 0.0  # the interval's audited step, not step time

    @contextlib.contextmanager
    def timing(self, phase: str, when: bool = True):
        """Adds the block's wall time to `phase` (where `when`)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = (time.perf_counter() - start) * when
            self.spent[phase] += spent
            if phase == "audited_step":
                self._audit_s += spent

    def interval(self, elapsed: float, steady: bool) -> None:
        """A logging interval's steps took `elapsed` seconds, its audited step's included."""
        self.spent["steady_steps" if steady else "warmup_steps"] += elapsed - self._audit_s
        self._audit_s = 0.0


class WallClock:
    """A run's clock: started where `run` is called; `part(name)` times a part of its startup;
    `breakdown` adds the fit's phases (the Meter's) and the teardown."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.startup = {"imports_s": _imports_s()}

    @contextlib.contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.startup[f"{name}_s"] = time.perf_counter() - start

    def breakdown(self, meter=None) -> dict:
        """The run's wall time by phase, to now; `meter`: the fit's (runner/train/telemetry.py),
        its start, length (`wall_time_s` of its summary) and phases. A run stopped before its fit
        (no meter, or one not started) spent it all in startup; one stopped in its fit (no
        summary of the fit's), the fit's to now."""
        now = time.perf_counter()
        started = getattr(meter, "started", now)
        fit = getattr(meter, "fit_wall_s", now - started)
        spent = meter.phases.spent if meter is not None else dict.fromkeys(FIT_PHASES, 0.0)
        phases = {f"{k}_s": spent[k] for k in FIT_PHASES}
        startup = self.startup["imports_s"] + started - self.origin
        out = {"startup_s": startup, **phases}
        out["logging_s"] = max(0.0, fit - sum(phases.values()))
        out["teardown_s"] = now - started - fit
        # the rest of startup: the config checked, the device probed, the tracker opened, ...
        other = startup - sum(self.startup.values())
        return out | {
            "total_s": self.startup["imports_s"] + now - self.origin,
            "startup_parts": self.startup | {"other_s": other},
        }
