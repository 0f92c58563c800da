"""The job's end time, and when to stop for it: SLURM's time limit (or trainer.time_limit_s) ends
the job whatever its step time, and SLURM's warning signal comes a fixed time before it, which a
long step (or two, under DDP) plus a checkpoint can outlast. So the run watches the clock itself:
before each step it asks whether the steps it would still take after asking to stop, the
checkpoint and the exit (trainer.time_limit_margin_s) fit before the end, and if not, asks for
the requeue now, as SLURM's SIGUSR2 would (runner/train/preemption.py). Host clock only: no
device read."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime

from runner import console

DECAY = 0.9  # a slow step (an evaluation, a compile) counts for the next ones, fading
WRITE_BYTES_PER_S = 100e6  # a checkpoint's time before one was measured: a slow disk's pace


class Deadline:
    """`end`: the time.monotonic() by which the job must be gone; `said`: where it comes from.
    `steps_after`: steps a stop asked for before a step still takes (1; 2 under DDP, where the
    flag is heard one step late); `checkpoint_s`: a checkpoint's time until one is measured."""

    def __init__(
        self, end: float, said: str, steps_after: int, margin_s: float, checkpoint_s: float
    ):
        self.end, self.said, self.steps_after, self.margin_s = end, said, steps_after, margin_s
        self.checkpoint_s = checkpoint_s
        self.step_s = 0.0  # the recent steps' time, the longest fading
        self._last: float | None = None

    def near(self) -> bool:
        """Before a step: True where the stop must be asked for now. A step asked for after
        this one would still take `steps_after` steps, then the checkpoint and the exit."""
        now = time.monotonic()
        if self._last is not None:
            self.step_s = max(now - self._last, self.step_s * DECAY)
        self._last = now
        need = (self.steps_after + 1) * self.step_s + self.checkpoint_s + self.margin_s
        return now + need >= self.end

    def checkpointed(self, seconds: float) -> None:
        """A checkpoint took `seconds`: the next one is expected to take as long."""
        self.checkpoint_s = seconds

    def why(self) -> str:
        left = max(0.0, self.end - time.monotonic())
        return (
            f"the time limit ({self.said} in {left:.0f} s; a step takes {_seconds(self.step_s)}, "
            f"a checkpoint {_seconds(self.checkpoint_s)})"
        )


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value >= 0.1 else f"{value * 1000:.1f} ms"


def slurm_end_time() -> tuple[float, str] | None:
    """The epoch time at which SLURM ends this job, and its name; None outside a SLURM job or
    where the job has no end (no time limit) or SLURM does not say. The job's environment has
    it from newer Slurm on (SLURM_JOB_END_TIME); else the controller is asked (squeue's %e, the
    EndTime that `scontrol show job` prints, in this machine's local time)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    said = f"SLURM job {job} ends"
    if os.environ.get("SLURM_JOB_END_TIME", "").isdigit():
        return float(os.environ["SLURM_JOB_END_TIME"]), said
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=20
        ).stdout.strip()
        return datetime.strptime(out, "%Y-%m-%dT%H:%M:%S").timestamp(), said
    except (OSError, subprocess.SubprocessError, ValueError):
        # Unlimited, or no answer: the job's signals are all there is (said, not an error).
        console.say(f"SLURM job {job}: no end time known here; its signals still checkpoint it")
        return None


def deadline_for(
    trainer_cfg, started: float, steps_after: int, state_bytes: int
) -> Deadline | None:
    """The fit's Deadline: trainer.time_limit_s seconds after the run `started` (monotonic), or
    with `auto` SLURM's end time where the job has one; None where neither applies.
    `state_bytes`: what a checkpoint writes, for its time until one is measured."""
    limit = trainer_cfg.get("time_limit_s", "auto")
    if limit is None:
        return None
    if limit == "auto":
        found = slurm_end_time()
        if found is None:
            return None
        end_epoch, said = found
        end = time.monotonic() + end_epoch - time.time()
    else:
        end, said = started + float(limit), f"trainer.time_limit_s={limit} runs out"
    margin = float(trainer_cfg.get("time_limit_margin_s", 15.0))
    return Deadline(end, said, steps_after, margin, 1.0 + state_bytes / WRITE_BYTES_PER_S)


def watch(trainer, run_signals) -> Deadline | None:
    """A fit's Deadline, where it answers the run's own signals (rank 0 watches the clock)."""
    if run_signals is None or not trainer.dist.main:
        return None
    after = 2 if trainer.dist.enabled else 1  # under DDP the flag is heard a step late
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in trainer.task.parameters())
    return deadline_for(trainer.cfg, run_signals.started, after, state_bytes)


@contextlib.contextmanager
def timed(deadline: Deadline | None) -> Iterator[None]:
    """The block (a checkpoint) timed: the next one is expected to take as long."""
    started = time.monotonic()
    yield
    if deadline is not None:
        deadline.checkpointed(time.monotonic() - started)
