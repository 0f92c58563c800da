"""Threads that fit the machine. torch's OpenMP threads wait for each other at every parallel
region's end, so a thread that shares its core with another busy process holds all the others
back: on a 2-core machine with one core taken, 2 threads run many times slower than 1
(docs/performance.md has the figures). At a CPU run's start this measures what other processes
take of the cores this process may use (/proc/stat against this process's own CPU time, over its
setup) and trains with the threads that are free, or the count the user set
(`trainer.cpu_threads`); parallel local jobs (the joblib launcher) each get their share."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig

from runner import console
from runner.measure.contention import usable_cores

SAMPLE_S = 0.2  # the least time the cores' use is read over
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_ticks() -> dict[int, int] | None:
    """Busy clock ticks per CPU since boot (/proc/stat), None off Linux."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    busy = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
            busy[int(name[3:])] = user + nice + system + irq + softirq + steal
    return busy


def _own_ticks() -> float:
    t = os.times()
    return (t.user + t.system) * _TICK


class Threads:
    """Started where a run starts (what other processes use is read from then); `fit` sets the
    training's threads, `restore` the process's own count again (runs in one process follow
    each other)."""

    def __init__(self) -> None:
        self.before = torch.get_num_threads()
        self._start = (time.perf_counter(), _cpu_ticks(), _own_ticks())

    def held_by_others(self) -> float | None:
        """The cores' worth of CPU other processes used, of those this process may run on,
        since the start (at least SAMPLE_S); None where the OS does not say."""
        began, ticks, own = self._start
        if ticks is None:
            return None
        time.sleep(max(0.0, SAMPLE_S - (time.perf_counter() - began)))
        now = _cpu_ticks() or {}
        try:
            mine = os.sched_getaffinity(0)
        except AttributeError:
            mine = set(now)
        busy = sum(now.get(c, 0) - ticks.get(c, 0) for c in mine)
        elapsed = (time.perf_counter() - began) * _TICK
        return max(0.0, (busy - (_own_ticks() - own)) / elapsed)

    def fit(self, setting: int | None, device: torch.device) -> dict:
        """Sets the threads (`trainer.cpu_threads`, else on a CPU those left free by other
        processes, and a parallel job's share); says where other processes hold cores.
        Returns summary.json's `cpu_threads` and `cores_held_by_others`."""
        threads, held = self.before, None
        if setting is not None:
            threads = setting
            console.say(f"cpu threads: {threads} (trainer.cpu_threads)")
            if device.type == "cpu" and threads > (cores := usable_cores()):
                console.say(
                    f"[yellow]warning:[/] trainer.cpu_threads={threads} is more than the {cores} "
                    "cores this process may use: its threads wait for each other's cores, and "
                    "its speed is contended (null takes the free cores)"
                )
        else:
            threads = min(threads, _job_share())
            if device.type == "cpu" and threads > 1 and (held := self.held_by_others()):
                cores = usable_cores()
                taken = min(cores - 1, round(held))
                if taken >= 1:
                    free = max(1, min(threads, cores - taken))
                    console.say(
                        f"[yellow]warning:[/] other processes hold {taken} of this process's "
                        f"{cores} cores ({held:.1f} cores' worth of CPU): {free} of its "
                        f"{threads} threads, one per free core (trainer.cpu_threads sets them)"
                    )
                    threads = free
        if threads != torch.get_num_threads():  # set only to change: the call itself is not
            torch.set_num_threads(threads)  # free (a run's bf16 bits differed after one)
        return {"cpu_threads": threads, "cores_held_by_others": held}

    def restore(self) -> None:
        if torch.get_num_threads() != self.before:
            torch.set_num_threads(self.before)


def _job_share() -> int:
    """Parallel local jobs (joblib launcher) share the cores: oversubscribed BLAS threads spin
    and slow every job many times over, so each job gets its share."""
    if HydraConfig.initialized():
        n_jobs = HydraConfig.get().launcher.get("n_jobs")
        if n_jobs:
            cores = os.cpu_count() or 1
            return max(1, cores // (cores if n_jobs < 0 else n_jobs))
    return torch.get_num_threads()
