"""Preemption: SIGTERM, SIGUSR1 or SIGUSR2 (a cluster wants the machine back, or its time limit
is near), from the first line of `run()` to its last (`handled`). Before training there is
nothing to save: the run stops at once, with its summary. In training the step in progress
finishes; the run then checkpoints and exits 75, after handing a SIGUSR1/SIGUSR2 on to the
handler that was there before it (`hand_on`). After the last step the run completes. A requeue
signal (SIGUSR1/SIGUSR2) decides, whatever comes after it: SLURM sends SIGTERM at the limit.
The job's end time (SLURM's, or trainer.time_limit_s) asks for the requeue itself, early enough
for the steps and the checkpoint still to come (runner/train/deadline.py).

With several ranks the signal may reach one of them only: each rank's flag travels with the
step's token count (the all-reduce every step runs anyway), and every rank reads the sum when it
books that step, so all stop at the same step, within one step of the signal."""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import time
from collections.abc import Callable, Iterator

from runner import console
from runner.errors import Preempted
from runner.train.distributed import Dist

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
REQUEUE_SIGNALS = ("SIGUSR1", "SIGUSR2")  # a cluster's "come back later": the job is requeued


class Signals:
    """What one run has been sent, and what it does about it at each stage:
    `waiting`: its record is not open yet: noted, and answered when setup begins;
    `setup`: nothing trained yet, nothing to save: the run stops at once (as Ctrl-C stops it);
    `training`: the run's fit answers it at the end of the step in progress;
    `done`: after the last step: noted, and the run completes."""

    current: Signals | None = None  # the run's, while `handled` runs it
    after_run: str | None = None  # a signal the last run completed despite (`late`)

    def __init__(self, stage: str = "waiting"):
        self.name: str | None = None  # the signal that decides
        self.why: str | None = None  # what sent it, where the runner did (the time limit)
        self.stage = stage
        self.started = time.monotonic()

    def receive(self, signum: int, _frame=None) -> None:
        self.request(signal.Signals(signum).name)

    def request(self, name: str, why: str | None = None) -> None:
        """`name` arrived (or the runner asks for it: `why`). A requeue signal, once come, stays
        the one that decides: the last signal does not win."""
        if self.name not in REQUEUE_SIGNALS:
            self.name, self.why = name, why
        if self.stage == "setup":
            self._stop()

    def setup(self) -> Signals:
        """The run's record is open: a signal from here to training stops it at once."""
        self.stage = "setup"
        if self.name is not None:
            self._stop()
        return self

    def _stop(self) -> None:
        self.stage = "stopping"  # a second signal while the run winds down is only noted
        raise Preempted(self.name, None)

    @contextlib.contextmanager
    def installed(self) -> Iterator[Signals]:
        """Catch the signals while the block runs (signal handlers live in the main thread)."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, self.receive) for sig in PREEMPTION_SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def handled(run: Callable) -> Callable:
    """`run()` with the signals caught from its first line to its last; a Preempted it raises
    carries the signal that decides (a requeue one that came while it wound down included)."""

    @functools.wraps(run)
    def wrapper(*args, **kwargs):
        signals = Signals()
        outer, Signals.current = Signals.current, signals
        try:
            with signals.installed():
                result = run(*args, **kwargs)
            Signals.after_run = signals.name  # the run completed all the same
            return result
        except Preempted as e:
            if signals.name in REQUEUE_SIGNALS and e.signal_name not in REQUEUE_SIGNALS:
                e.signal_name = signals.name  # hand_on requeues
            raise
        finally:
            Signals.current = outer

    return wrapper


def late() -> str | None:
    """The signal that came in the last run's last step or after it (the run completed): the
    process was still asked to stop, which a sweep's next job must not ignore."""
    name, Signals.after_run = Signals.after_run, None
    return name


def between_jobs() -> None:
    """From here on, where no run catches them (a sweep's look, the start of its next round):
    a signal, Ctrl-C's too, noted for `late`, so that the sweep stops before its next job, in
    words and exit 75, not killed where it stands (SIGTERM's default) nor with a traceback
    (SIGINT's). A run catches its own (`handled`); `run_begins` gives Ctrl-C back to it."""
    if threading.current_thread() is threading.main_thread():
        for sig in (*PREEMPTION_SIGNALS, signal.SIGINT):
            signal.signal(sig, _note)


def _note(signum: int, _frame=None) -> None:
    Signals.after_run = Signals.after_run or signal.Signals(signum).name


def run_begins() -> None:
    """A run starts: Ctrl-C interrupts it again (its KeyboardInterrupt: runner/run.py) where
    `between_jobs` took it; a launcher's own handler (a joblib worker's) stays."""
    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGINT) is _note:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def setup_begins() -> Signals | None:
    """The run's signals, now answered at once until its training starts (runner/run.py)."""
    return Signals.current.setup() if Signals.current is not None else None


class Preemption:
    """One fit's view of the signals: the flag it sends with each step's count, and whether to
    stop."""

    def __init__(self, dist: Dist):
        self.dist = dist
        self.signals: Signals | None = None  # those this fit answers, while it runs
        self.heard = False  # some rank's flag arrived in a step's count

    @contextlib.contextmanager
    def installed(self, run: Signals | None = None):
        """The block answers `run`'s signals (the run's own fit: from setup to `done`); outside
        any run, signals of its own; nested in a run (an island search's or max-batch search's
        trials, a projection's timing), none: the run's stage decides."""
        if run is not None:
            self.signals, run.stage = run, "training"
            try:
                yield
            finally:
                run.stage = "done"
        elif Signals.current is not None:
            yield
        else:
            with Signals("training").installed() as self.signals:
                yield

    @property
    def signal(self) -> str | None:
        """The signal this process received (or the runner's time limit asked for)."""
        return self.signals.name if self.signals is not None else None

    @property
    def why(self) -> str | None:
        return self.signals.why if self.signals is not None else None

    def completes(self, last: bool) -> bool:
        """A stop asked for in the last step: nothing is left to come back for, so the run
        completes (said)."""
        if last:
            stopper = self.why or self.signal or "a signal to another rank"
            console.say(f"{stopper} in the last step: the run completes")
        return last

    def time_up(self, why: str) -> None:
        """The job's end time is near: stop as a SIGUSR2 would (submitit's requeue)."""
        if self.signals is not None and self.signals.name is None:
            self.signals.request("SIGUSR2", why)

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
    if signal_name not in REQUEUE_SIGNALS:
        return
    handler = signal.getsignal(signal.SIGUSR2)
    if callable(handler):
        handler(signal.SIGUSR2, None)
