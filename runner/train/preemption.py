"""Preemption: SIGTERM, SIGUSR1 or SIGUSR2 (a cluster wants the machine back, or its time limit
is near). The step in progress finishes; the run then checkpoints and exits 75, after handing a
SIGUSR1/SIGUSR2 on to the handler that was there before it (`hand_on`). With several ranks the signal may reach one of
them only: each rank's flag travels with the step's token count (the all-reduce every step runs
anyway), and every rank reads the sum when it books that step, so all stop at the same step,
within one step of the signal."""

from __future__ import annotations

import contextlib
import signal
import threading

from runner.train.distributed import Dist

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class Preemption:
    def __init__(self, dist: Dist):
        self.dist = dist
        self.signal: str | None = None  # the signal this process received
        self.heard = False  # some rank's flag arrived in a step's count

    @contextlib.contextmanager
    def installed(self):
        """Catch the signals while the block runs (signal handlers live in the main thread)."""
        previous = {}
        if threading.current_thread() is threading.main_thread():

            def handle(signum, _frame):
                self.signal = signal.Signals(signum).name

            previous = {sig: signal.signal(sig, handle) for sig in PREEMPTION_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @property
    def flag(self) -> bool:
        """This rank's flag, sent with the next step's count."""
        return self.signal is not None

    def hear(self, ranks_signalled: float) -> None:
        """A booked step's count said how many ranks had been signalled."""
        self.heard = self.heard or ranks_signalled > 0

    @property
    def requested(self) -> bool:
        """Stop now: one process needs nobody's word; several ranks decide on what every one of
        them has heard, the same at the same step."""
        return self.heard if self.dist.enabled else self.signal is not None


def hand_on(signal_name: str) -> None:
    """After the checkpoint, the signal's own business. A job of submitit's (`+launcher=slurm`)
    has its handler on SIGUSR2, the time-limit signal it asks SLURM for: it requeues the job
    (within `max_num_timeout`) and exits; SIGUSR1, a user's `--signal`, asks the same of it.
    SIGTERM needs nobody: SLURM requeues a job it stops so (`scontrol requeue`, preemption), and
    a cancelled job stays cancelled. Outside such a job: nothing (the run exits 75)."""
    if signal_name not in ("SIGUSR1", "SIGUSR2"):
        return
    handler = signal.getsignal(signal.SIGUSR2)
    if callable(handler):
        handler(signal.SIGUSR2, None)
