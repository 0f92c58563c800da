"""`hydra/launcher=joblib`'s launcher: Hydra's joblib launcher, made safe for preemption.

- One job's end never ends another: a job that exits (a preempted one exits 75) returns from its
  worker instead; otherwise loky would carry the SystemExit to this process, and joblib would
  kill every other job mid-step. Its summary.json says how it ended, and the comparison names it.
- A signal to the sweep (SIGTERM, SIGUSR1/2, Ctrl-C; to this process or to its whole group)
  reaches every worker as a preemption signal, so each running job checkpoints after its step;
  no job starts after it; this process waits for them all, then compares what it has. Workers
  ignore Ctrl-C themselves: it is this process's to forward, and an idle worker that died of it
  would break the pool.
- A worker that dies (killed, out of memory) ends joblib's whole pool: the comparison still runs,
  naming the jobs it lost (runner/launch/local.py)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.plugins.search_path_plugin import SearchPathPlugin
from hydra_plugins.hydra_joblib_launcher.config import JobLibLauncherConf
from hydra_plugins.hydra_joblib_launcher.joblib_launcher import (
    JoblibLauncher as HydraJoblibLauncher,
)

# What a scheduler or a terminal sends to stop the sweep; Ctrl-C reaches the workers as SIGTERM
# (the signals their training loop takes as preemption), the others as they are.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class JoblibLauncher(HydraJoblibLauncher):
    def launch(self, job_overrides, initial_job_idx):
        from joblib import effective_n_jobs
        from joblib.externals.loky.process_executor import TerminatedWorkerError

        if effective_n_jobs(self.joblib.get("n_jobs")) == 1:
            # joblib runs the jobs here, one after the other: as the basic launcher does, a
            # preempted job ends the sweep (runner/__main__.py)
            return super().launch(job_overrides, initial_job_idx)
        task = self.task_function
        with tempfile.TemporaryDirectory(prefix="amp-runner-sweep-") as folder:
            stop = SweepStop(Path(folder) / "stopped")
            self.task_function = InWorker(task, stop.marker, os.getpid())
            self.joblib["initializer"] = worker_started
            try:
                with stop.installed():
                    return super().launch(job_overrides, initial_job_idx)
            except TerminatedWorkerError as e:
                from runner.launch.local import after_dead_worker

                return after_dead_worker(self, job_overrides, initial_job_idx, e)
            finally:
                self.task_function = task


def worker_started() -> None:
    """loky's worker initializer: outside a job's training loop (which installs its own
    handlers), a preemption signal or Ctrl-C does not kill the worker. The sweep's process
    stops the sweep; a dead worker would break joblib's pool, and joblib would kill the others."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class InWorker:
    """The job function as a worker runs it: not at all once the sweep is stopping (`stop`
    exists), and a job that exits returns None (its summary.json says why it stopped)."""

    # A plain class, not a dataclass: Hydra's plugin scan runs this file outside sys.modules.
    def __init__(self, task_function: Callable[[Any], Any], stop: Path, sweep_pid: int):
        self.task_function, self.stop, self.sweep_pid = task_function, stop, sweep_pid

    def __call__(self, cfg: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig

        from runner.launch.jobs import SweepJob, record, say

        node = HydraConfig.get()
        if self.stop.exists():
            why = f"not started: the sweep was stopped by {self.stop.read_text() or 'a signal'}"
            folder = Path(node.runtime.output_dir)
            job = SweepJob(node.job.num, list(node.overrides.task), cfg, folder, "")
            record(job, "joblib", "STOPPED", why)
            say(f"job #{node.job.num}: {why}")
            return None
        try:
            return self.task_function(cfg)
        except SystemExit:
            if os.getpid() == self.sweep_pid:  # not in a worker: the sweep's own exit
                raise
            return None


class SweepStop:
    """A signal to the sweep's process: said once, forwarded to every worker (again each second
    while they run, for a job that was setting up and had no handler yet), and recorded in
    `marker` for the workers, which start no job after it."""

    def __init__(self, marker: Path):
        self.marker = marker
        self.done = threading.Event()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers live in the main thread
            return
        previous = {sig: signal.signal(sig, self.handle) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            self.done.set()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle(self, signum: int, _frame) -> None:
        forward = signal.SIGTERM if signum == signal.SIGINT else signal.Signals(signum)
        if not self.marker.exists():
            from runner.launch.jobs import say

            self.marker.write_text(signal.Signals(signum).name)
            say(
                f"{signal.Signals(signum).name}: stopping the sweep: each running job saves a "
                "checkpoint after its current step, and no other job starts"
            )
            threading.Thread(target=self.repeat, args=(forward,), daemon=True).start()
        self.forward(forward)

    def repeat(self, sig: signal.Signals) -> None:
        while not self.done.wait(1.0):
            self.forward(sig)

    @staticmethod
    def forward(sig: signal.Signals) -> None:
        for worker in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, sig)


def store() -> None:
    """`hydra/launcher=joblib` is this launcher, with the plugin's own keys and defaults: the
    option is stored again over the plugin's."""
    ConfigStore.instance().store(
        group="hydra/launcher",
        name="joblib",
        node=JobLibLauncherConf(_target_=f"{__name__}.JoblibLauncher"),
        provider="amp_runner",
    )


class JoblibOption(SearchPathPlugin):
    """Stores the option again once Hydra has scanned every plugin: its scan runs each plugin's
    modules again, in sys.path's order, and where the project's folder comes first (a command
    run from the repository's root), the joblib plugin's config module runs after this one and
    stores Hydra's launcher back. Configs are composed after the scan."""

    def manipulate_search_path(self, search_path) -> None:
        store()


store()
