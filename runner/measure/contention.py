"""What the process got of the machine while it was timed: each timed window's CPU, as the kernel
accounts it per thread (/proc/self/task/*/schedstat: time on a core, and time runnable but
waiting for one), the process's CPU time against the window's wall time × its threads, the
machine's other runnable tasks, and on a GPU the device's other processes (NVML, where pynvml is
installed). A window where a busy thread of the run got under CONTENDED_BELOW of the CPU it was
ready to use is contended: another process (or too many threads of its own) held its cores, and
its speed says nothing of the run's.

A thread that waits for a lock, a barrier or the GPU sleeps and is not runnable: only time it
could have run and did not counts against it, so a step that is mostly single-threaded Python is
not contended for leaving its other threads idle."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

# A busy thread that got under this share of the CPU it was ready to use marks its window
# contended: a core shared with one other busy process gives each about half; alone, a thread
# waits a few percent at most (interrupts, the kernel's own threads).
CONTENDED_BELOW = 0.6
# Another threshold, for the test suite: its runs share a machine whatever it does, and only the
# tests of contention itself ask (tests/conftest.py sets 0, under which nothing is contended).
THRESHOLD_ENV = "AMP_RUNNER_CONTENDED_BELOW"
BUSY_SHARE = 0.1  # a thread ready to run under this share of the window's wall time is idle
MIN_WINDOW_S = 0.05  # a shorter window is a few of the scheduler's slices: not judged
_TASKS = Path("/proc/self/task")


def _thread_times() -> dict[str, tuple[int, int]] | None:
    """Per thread of this process: (ns on a core, ns runnable but waiting), since it started;
    None where the kernel does not account them (not Linux, or no schedstats)."""
    times = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    for tid in tids:
        try:
            ran, waited, _ = (_TASKS / tid / "schedstat").read_text().split()
        except (OSError, ValueError):
            continue  # it ended meanwhile
        times[tid] = (int(ran), int(waited))
    return times or None


def runnable_tasks() -> int | None:
    """The machine's runnable tasks now, this process's running threads included (/proc/stat's
    procs_running); None off Linux."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("procs_running "):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


class Window:
    """One timed window's share of the machine: `start()` at its beginning, `read()` at its end
    (which starts the next)."""

    def __init__(self, device: torch.device | None = None):
        self.gpu = GpuShare(device) if device is not None and device.type == "cuda" else None
        self.start()

    def start(self) -> None:
        self._wall = time.perf_counter()
        self._cpu = time.process_time()
        self._threads = _thread_times()
        if self.gpu is not None:
            self.gpu.start()

    def read(self) -> dict:
        """The window's record (`contention` below), and the next window starts."""
        wall = time.perf_counter() - self._wall
        cpu = time.process_time() - self._cpu
        before, after = self._threads, _thread_times()
        record = contention(before, after, wall, cpu, torch.get_num_threads())
        if self.gpu is not None:
            record |= self.gpu.read()
            if record["gpu_contended"]:  # else the CPU's word stands (None: unmeasured)
                record["contended"] = True
        self.start()
        return record


def contention(
    before: dict | None, after: dict | None, wall: float, cpu: float, threads: int
) -> dict:
    """A window's record: `cpu_share`, the CPU time its threads got of what they were ready to
    use (on a core / on a core or waiting for one); `worst_thread_share`, that of its busiest-
    waiting busy thread; `cpu_of_threads`, its CPU time over wall time × torch's threads;
    `others_runnable`, the machine's other runnable tasks at its end; `contended` (None,
    unmeasured, where the kernel keeps no per-thread accounts or the window is under
    MIN_WINDOW_S)."""
    record = {
        "cpu_of_threads": cpu / (wall * threads) if wall > 0 else None,
        "others_runnable": None,
        "cpu_share": None,
        "worst_thread_share": None,
        "contended": None,
    }
    if before is None or after is None or wall < MIN_WINDOW_S:
        return record
    ran = waited = 0
    worst = 1.0
    mine = 0
    for tid, (run_ns, wait_ns) in after.items():
        run0, wait0 = before.get(tid, (0, 0))
        r, w = run_ns - run0, wait_ns - wait0
        ran, waited = ran + r, waited + w
        if (r + w) / 1e9 >= BUSY_SHARE * wall:
            worst = min(worst, r / (r + w))
            mine += 1
    share = ran / (ran + waited) if ran + waited else 1.0
    running = runnable_tasks()
    return record | {
        "cpu_share": share,
        "worst_thread_share": worst,
        "others_runnable": None if running is None else max(0, running - mine),
        "contended": worst < float(os.environ.get(THRESHOLD_ENV, CONTENDED_BELOW)),
    }


def describe(c: dict) -> str:
    """A run's `contention` (runner/train/speed.py) in words: "the run had 41% of its threads'
    CPU" (a thread's least where it differs), and the GPU's other processes where there were
    any."""
    words = []
    if c.get("cpu_share") is not None:
        words.append(f"the run had {c['cpu_share']:.0%} of its threads' CPU")
        worst = c.get("worst_thread_share")
        if worst is not None and round(worst, 2) < round(c["cpu_share"], 2):
            words[-1] += f" (a thread {worst:.0%})"
    if c.get("gpu_others"):
        words.append(f"{c['gpu_others']} other processes computed on its GPU")
    return "; ".join(words) or "another process held its cores"


class GpuShare:
    """The device's other processes and their share of its SMs over a window, read from NVML
    (pynvml); where pynvml is missing or NVML cannot answer, the window's GPU is unmeasured."""

    def __init__(self, device: torch.device):
        self.handle = self.nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # no pynvml, no driver library: unmeasured, the run goes on
            self.nvml = None
        self._since = 0

    def start(self) -> None:
        self._since = int(time.time() * 1e6)  # NVML's sample timestamps: µs since the epoch

    def read(self) -> dict:
        """`gpu_others`: the other processes computing on the device; `gpu_others_sm`: their
        share of its SMs over the window (summed samples); `gpu_utilization`: the device's;
        `gpu_contended`: where another process used over a tenth of its SMs (or, where NVML
        keeps no per-process samples, where another process computes on it at all)."""
        empty = dict.fromkeys(("gpu_others", "gpu_others_sm", "gpu_utilization"))
        if self.nvml is None:
            return empty | {"gpu_contended": False}
        nvml, me = self.nvml, os.getpid()
        try:
            others = [
                p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(self.handle) if p.pid != me
            ]
            busy = nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu / 100
        except Exception:
            return empty | {"gpu_contended": False}
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(self.handle, self._since)
            sm = sum(s.smUtil for s in samples if s.pid != me) / 100
        except Exception:  # no samples in the window, or not supported
            sm = None
        contended = bool(others) and (sm is None or sm > 0.1)
        return {
            "gpu_others": len(others),
            "gpu_others_sm": sm,
            "gpu_utilization": busy,
            "gpu_contended": contended,
        }
