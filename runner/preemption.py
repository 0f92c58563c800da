"""Preemption: SIGTERM or SIGUSR1 (a cluster wants the machine back). The step in progress
finishes; at the next flush point the run checkpoints and exits 75. With several ranks the
signal may reach one of them only: every flush point asks all ranks, so all stop at one step."""

from __future__ import annotations

import contextlib
import signal
import threading

import torch

from runner import distributed
from runner.distributed import Dist

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    def __init__(self, dist: Dist, device: torch.device):
        self.dist, self.device = dist, device
        self.signal: str | None = None  # the signal this process received

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
    def at_once(self) -> bool:
        """One process needs nobody's word: it stops at the step it was signalled in."""
        return not self.dist.enabled and self.signal is not None

    def poll(self) -> bool:
        """At a flush point, which every rank reaches at the same step: was any rank signalled?"""
        if not self.dist.enabled:
            return self.signal is not None
        flag = torch.tensor(float(self.signal is not None), device=self.device)
        return bool(distributed.sum_(flag, self.dist).item())
