"""Speed figures that know when the machine was shared (issue 49): each timed window's share of
the machine, a contended run's speed said and untested, its MFU left out, a contended row never
"faster" in a comparison, contended interleaved rounds timed again, threads that fit the cores
other processes leave free. The runs beside busy processes decide from the run's own records
(metrics.jsonl, summary.json), never from a timing threshold."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from runner.build import build
from runner.compare import compare
from runner.compare.interleave import clean_rounds
from runner.measure import contention
from runner.run import run
from runner.train.speed import steady_speed
from runner.train.threads import Threads
from tests.helpers import TINY_MLP, make_cfg, read_metrics
from tests.test_compare import fake_job

# The busy processes and the runs beside them, one after the other on one worker
pytestmark = pytest.mark.xdist_group("contention")
ACCOUNTED = contention._thread_times() is not None  # Linux's per-thread schedstat
needs_accounts = pytest.mark.skipif(not ACCOUNTED, reason="no per-thread CPU accounts here")
# 70 steps of an MLP on one thread, timed in windows of 20 (each over 50 ms, contended or
# not: long enough for the scheduler's shares to show); no model library to import
RUN = [
    *TINY_MLP,
    "model.hidden_size=256",
    "model.num_layers=4",
    "dataset.batch_size=256",
    "trainer.max_steps=70",
    "trainer.log_every_n_steps=20",
    "trainer.benchmark.warmup_steps=10",
    "trainer.val_check_interval=0",
    "trainer.cpu_threads=1",
]


@pytest.fixture
def real_threshold(monkeypatch):
    """The runner's own threshold (the suite sets none: tests/conftest.py)."""
    monkeypatch.delenv(contention.THRESHOLD_ENV, raising=False)


def busy_loops(core: int, n: int) -> list[subprocess.Popen]:
    """`n` processes that spin on `core`, started and spinning."""
    code = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]
    time.sleep(0.5)  # their interpreters up and spinning
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


@needs_accounts
def test_a_run_beside_busy_processes_on_its_core_is_contended_and_its_speed_untested(
    tmp_path, real_threshold, capsys
):
    """Two busy loops on the run's one core: each of its windows got about a third of its
    thread's CPU; the speed is said contended and untested, and MFU is left out."""
    core = max(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    build(make_cfg(*RUN))  # its modules imported before its core is shared
    procs = busy_loops(core, 2)
    try:
        os.sched_setaffinity(0, {core})  # this thread, and the threads it starts
        s = run(make_cfg(*RUN, f"cache_dir={tmp_path}"), tmp_path / "run")
    finally:
        os.sched_setaffinity(0, mine)
        stop(procs)
    steady = [r for r in read_metrics(tmp_path / "run") if r["steady"]]
    assert steady and all(r["contended"] for r in steady)
    assert all(r["worst_thread_share"] < contention.CONTENDED_BELOW for r in steady)
    c = s["contention"]
    assert s["speed_contended"] is True and c["contended_windows"] == c["windows"] == len(
        {r["step_time_s"] for r in steady}
    )
    assert s["speed_note"].startswith("contended: the run had ") and "untested" in s["speed_note"]
    assert s["mfu"] is None and "MFU left out" in s["peak_note"]
    printed = " ".join(capsys.readouterr().out.split())
    assert "contended: the run had" in printed and "— untested" in printed


@needs_accounts
def test_the_same_run_alone_is_not_contended(tmp_path, real_threshold):
    """The run without busy processes of the test's: its windows are clean, its speed stands.
    Where the machine itself was busy with other work (more than the cores but one, over the
    run), no run on it is alone: skipped then, as the run's record would rightly say."""
    cores = contention.usable_cores()
    if cores < 2:
        pytest.skip("one usable core: a run shares it with the test suite itself")
    others = Threads()  # what other processes use, over the run
    s = run(make_cfg(*RUN, f"cache_dir={tmp_path}"), tmp_path / "run")
    held = others.held_by_others()
    if s["speed_contended"] and held is not None and held > cores - 0.75:
        pytest.skip(f"the machine was busy with other work ({held:.1f} of {cores} cores)")
    assert s["contention"]["measured"] and s["speed_contended"] is False
    assert 2 * s["contention"]["contended_windows"] <= s["contention"]["windows"]
    assert s["samples_per_s"] > 0


def test_a_window_is_contended_where_a_busy_thread_waited_for_its_core(real_threshold):
    """schedstat's (ns on a core, ns waiting): a thread that ran 0.3 s and waited 0.7 s of a
    1 s window is contended; one that slept is not counted; none waiting is clean."""
    before = {"1": (0, 0), "2": (0, 0)}
    shared = contention.contention(before, {"1": (3e8, 7e8), "2": (1e6, 0)}, 1.0, 0.3, 2)
    assert shared["contended"] and shared["worst_thread_share"] == pytest.approx(0.3)
    assert shared["cpu_of_threads"] == pytest.approx(0.15)
    alone = contention.contention(before, {"1": (9.9e8, 1e7), "2": (1e6, 5e6)}, 1.0, 1.0, 2)
    assert alone["contended"] is False and alone["cpu_share"] == pytest.approx(0.985, abs=1e-3)
    assert contention.contention(None, None, 1.0, 1.0, 1)["contended"] is None  # unmeasured
    assert contention.contention(before, before, 0.01, 0.0, 1)["contended"] is None  # too short


def _rows(contended: list[bool]) -> list[dict]:
    """Two steps a window, at 1 s a step in clean windows and 3 s in contended ones."""
    rows = []
    for i, c in enumerate(contended):
        for k in (1, 2):
            t = 3.0 + i if c else 1.0 + i / 100  # each window its own time, as measured
            rows.append(
                {"step": 2 * i + k, "step_time_s": t, "samples_per_s": 8 / t, "tokens_per_s": 0}
                | {"data_wait_s": 0.0, "steady": True, "contended": c, "cpu_share": 0.4 if c else 1}
                | {"worst_thread_share": 0.4 if c else 1.0}
            )
    return rows


def test_contended_windows_are_left_out_where_most_were_clean_else_the_speed_is_contended():
    mostly_clean = steady_speed(_rows([False, True, False, False]), 0)
    assert mostly_clean["speed_contended"] is False and mostly_clean["step_time_s"] == 1.02
    assert mostly_clean["speed_intervals"] == 3 and "left out" in mostly_clean["speed_note"]
    mostly_shared = steady_speed(_rows([True, True, False]), 0)
    assert mostly_shared["speed_contended"] is True and mostly_shared["step_time_s"] == 3.0
    assert mostly_shared["speed_note"].startswith("contended: the run had 40% of its threads' CPU")


def test_a_sweep_whose_one_job_ran_contended_never_calls_that_row_faster(tmp_path):
    """bf16 at 1.5× fp32's speed, timed while another process held its cores: untested, named,
    with the way to a clean figure; the same for every row where the baseline ran contended."""
    shared = {
        "speed_contended": True,
        "contention": {"words": "the run had 35% of its threads' CPU"},
    }
    fake_job(tmp_path / "a" / "0", "fp32", speed=100.0, iqr=1.0)
    fake_job(tmp_path / "a" / "1", "bf16", speed=150.0, iqr=1.0, summary=shared)
    fp32, bf16 = compare(tmp_path / "a", wandb_log=False)
    assert bf16.figures["speed_contended"] and "faster" not in bf16.verdict
    assert bf16.verdict.endswith(
        "— speed untested: bf16 ran contended (the run had 35% of its threads' CPU); for a clean "
        "figure, time it on a quiet machine, or compare with runner.speed=interleaved"
    )
    assert fp32.verdict == "baseline — recommended: no mode is shown to be faster here"
    fake_job(tmp_path / "b" / "0", "fp32", speed=100.0, iqr=1.0, summary=shared)
    fake_job(tmp_path / "b" / "1", "bf16", speed=150.0, iqr=1.0)
    _, bf16 = compare(tmp_path / "b", wandb_log=False)
    assert "faster" not in bf16.verdict and "— speed untested: fp32 ran contended" in bf16.verdict


def test_a_contended_interleaved_round_is_timed_again_in_its_order_or_said():
    """Round 2 (reversed order) is contended the first time: timed again, reversed again; a
    round contended every time stays, once the retries (as many as the rounds) are spent."""
    calls: list[str] = []
    shared = {2}  # the calls that are contended

    def timer(key: str):
        def fit() -> dict:
            calls.append(key)
            return {"samples_per_s": 1.0, "speed_contended": len(calls) in shared}

        return fit

    timers = {"fp32": timer("fp32"), "bf16": timer("bf16")}
    results, redone = clean_rounds(timers, 2)
    assert calls == ["fp32", "bf16", "fp32", "bf16", "bf16", "fp32"] and redone == 1
    assert not any(s["speed_contended"] for r in results.values() for s in r)
    calls.clear()
    shared.update(range(1, 20))
    results, redone = clean_rounds(timers, 2)
    assert redone == 2 and len(calls) == 8  # 2 rounds + 2 retries, then said
    assert all(s["speed_contended"] for s in results["fp32"])


def test_cpu_threads_sets_the_count_and_a_run_restores_the_process_own():
    threads = Threads()
    assert threads.fit(3, torch.device("cpu"))["cpu_threads"] == 3 == torch.get_num_threads()
    threads.restore()
    assert torch.get_num_threads() == threads.before


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="no /proc/stat: no cores' use")
def test_a_core_held_by_another_process_leaves_the_run_the_free_ones(capsys):
    """Two cores, one of them spun on by another process: the run trains on one thread and says
    why."""
    mine = os.sched_getaffinity(0)
    if len(mine) < 2:
        pytest.skip("one usable core: none to leave free")
    two = set(sorted(mine)[:2])
    procs = busy_loops(max(two), 1)
    before = torch.get_num_threads()
    try:
        os.sched_setaffinity(0, two)
        torch.set_num_threads(2)
        threads = Threads()
        got = threads.fit(None, torch.device("cpu"))
        threads.restore()
    finally:
        torch.set_num_threads(before)
        os.sched_setaffinity(0, mine)
        stop(procs)
    assert got["cores_held_by_others"] >= 0.7 and got["cpu_threads"] == 1
    said = " ".join(capsys.readouterr().err.split())
    assert (
        "other processes hold 1 of this process's 2 cores" in said and "1 of its 2 threads" in said
    )


def test_a_gpu_shared_with_another_process_is_contended_and_no_nvml_is_unmeasured(monkeypatch):
    """NVML (a stand-in pynvml): another process on the device using 40% of its SMs over the
    window makes it contended; without pynvml the GPU is unmeasured and the run goes on."""
    me, other = SimpleNamespace(pid=os.getpid(), smUtil=50), SimpleNamespace(pid=1, smUtil=40)
    nvml = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetComputeRunningProcesses=lambda h: [me, other],
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=90),
        nvmlDeviceGetProcessUtilization=lambda h, since: [me, other],
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    shared = contention.GpuShare(torch.device("cuda", 0))
    shared.start()
    assert shared.read() == {
        "gpu_others": 1,
        "gpu_others_sm": 0.4,
        "gpu_utilization": 0.9,
        "gpu_contended": True,
    }
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` fails
    assert contention.GpuShare(torch.device("cuda", 0)).read()["gpu_others"] is None
