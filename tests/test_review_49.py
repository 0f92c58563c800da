"""Review of issue 49 (speed figures that know when the machine was shared, and where a run's
wall time went): cases built to break it, each with a truth known without timing anything.
Contention here is decided from the run's own records, never from a timing threshold."""

from __future__ import annotations

import pytest

from runner.compare import compare
from runner.compare.report import table
from tests.test_compare import fake_job
from tests.test_wall_time import PHASES as WALL_PHASES
from tests.test_wall_time import until_summary

SHARED = {
    "speed_contended": True,
    "contention": {"words": "the run had 35% of its threads' CPU"},
}


def _columns(groups) -> dict[str, dict[str, str]]:
    """compare.md's cells by row label and column name."""
    head, *rows = table(groups)
    return {row[0]: dict(zip(head, row, strict=True)) for row in rows}


def test_the_speedup_column_never_shows_a_contended_rows_ratio_as_if_clean(tmp_path, capsys):
    """bf16 timed at 1.5× fp32 while another process held its cores (or fp32 timed so): the
    table's speed ratios say untested, its own speed cells say contended, the printed table's
    speedup too; a clean row beside a clean baseline keeps its figures."""
    for sweep, shared_row in (("a", "bf16"), ("b", "fp32")):
        for i, mode in enumerate(("fp32", "bf16", "fp16")):
            summary = SHARED if mode == shared_row else None
            fake_job(tmp_path / sweep / str(i), mode, speed=100.0 + 50 * i, summary=summary)
        groups = compare(tmp_path / sweep, wandb_log=False)
        cells = _columns(groups)
        untested = ("bf16", "fp16") if shared_row == "fp32" else ("bf16",)
        for label in untested:
            assert cells[label]["speedup"] == "untested (contended)", (sweep, cells[label])
            assert cells[label]["to target"] == "untested (contended)"
        assert cells[shared_row]["samples/s"].endswith("(contended)")
        assert cells[shared_row]["time to target"].endswith("(contended)")
        if shared_row == "bf16":
            assert cells["fp16"]["speedup"] == "2.00×"  # clean, beside a clean baseline
        printed = capsys.readouterr().out
        row = next(line for line in printed.splitlines() if line.startswith("bf16 "))
        assert "contended" in row and "1.50×" not in row


def _interleaved_sweep(root, monkeypatch, contended_timing: bool, peak_note: str | None):
    """fp32 and bf16 jobs with their FLOPs and a 1 TFLOP/s peak, timed again interleaved at 100
    and 130 samples/s; the timing `contended_timing`, the jobs' peak measured contended where
    `peak_note` says so (as runner/measure/flops.py's utilisation writes it)."""
    from runner.compare import interleave
    from tests.test_interleave import interleaved_timing

    runner = {"speed": "interleaved", "speed_rounds": 2, "speed_steps": 3}
    peak = {"flops_per_step": 1e9, "peak_tflops": 1.0, "mfu": None if peak_note else 0.01}
    if peak_note:
        peak |= {"peak_note": peak_note, "peak_contended": True}
    for i, mode in enumerate(("fp32", "bf16")):
        fake_job(root / str(i), mode, speed=100.0, iqr=1.0, runner=runner, summary=peak)

    def time_configs(configs, rounds, steps):
        timing = interleaved_timing(configs, 130.0)
        for figures in timing.values():
            figures |= {"speed_contended": contended_timing, "contention": "the run had 30%"}
        return timing

    monkeypatch.setattr(interleave, "time_configs", time_configs)
    return compare(root, wandb_log=False)


def test_interleaved_mfu_is_left_out_where_its_timing_or_its_peak_was_contended(
    tmp_path, monkeypatch
):
    """MFU from the interleaved step time: never from a contended timing, never against a peak
    measured while other processes held the cores; a clean timing and peak keep it."""
    noted = "the fp32 peak was measured while other processes held the cores (30%): MFU left out"
    for name, shared, note in (("a", True, None), ("b", False, noted), ("c", False, None)):
        for g in _interleaved_sweep(tmp_path / name, monkeypatch, shared, note):
            mfu = g.figures["mfu"]
            if shared or note:
                assert mfu != mfu or mfu is None, (name, g.label, mfu)  # nan: left out
            else:
                assert 0 < mfu < 1, (name, g.label, mfu)


def test_a_summary_says_its_peak_was_measured_contended(tmp_path, monkeypatch):
    """utilisation's record of a CPU peak timed while other processes held the cores: MFU left
    out and `peak_contended`, which the comparison's interleaved MFU reads (above)."""
    import torch

    from runner.measure import flops
    from runner.precision import DeviceCaps, mode_of

    shared = {"tflops": 1.0, "median_tflops": 1.0, "contended": True, "cpu_share": 0.3}
    monkeypatch.setattr(flops, "_measure_matmul_tflops", lambda dtype: shared)
    caps = DeviceCaps.probe(torch.device("cpu"))
    got = flops.utilisation(
        {"flops_per_step": 1e9, "step_time_s": 1.0}, caps, mode_of("fp32"), tmp_path
    )
    assert got["mfu"] is None and got["peak_contended"] is True
    assert "measured while other processes held the cores" in got["peak_note"]


def test_each_interleaved_round_is_timed_and_judged_on_its_own_steps():
    """A timing's call (one interleaved round) gives the speed and contention of its own timed
    window: not the median over every earlier round's (a contended round after clean ones was
    left out silently, its rate an earlier round's, and never timed again)."""
    from contextlib import ExitStack

    from runner.train.session import prepared, trainer_timer, workspace
    from tests.helpers import TINY_MLP, make_cfg

    cfg = make_cfg(*TINY_MLP, "trainer.max_steps=100")
    with ExitStack() as stack:
        device, data, task, log = workspace(cfg, stack)
        variant, precision = prepared(cfg, task, device, stack)
        fit = trainer_timer(cfg, variant, data, precision, log, 2, 5)
        rounds = [fit() for _ in range(3)]
    assert [s["speed_intervals"] for s in rounds] == [1, 1, 1]
    assert [s["contention"]["windows"] for s in rounds] == [1, 1, 1]


def _adds_up(wall: dict, started: float, folder) -> None:
    """The breakdown's phases add up to its total, within 2% of a clock from the call of `run`
    (`started`, time.time()) to the summary's writing (summary.json's modification time): what
    comes after the summary's last figure (its fsync, the printed table) is not in it, and on a
    loaded machine took 2% of a 1.7 s run."""
    assert set(WALL_PHASES) <= wall.keys() and all(wall[k] >= 0 for k in WALL_PHASES), wall
    added = sum(wall[k] for k in WALL_PHASES)
    assert abs(added - wall["total_s"]) < 1e-6
    took = until_summary(started, folder)
    assert abs(added - took) <= 0.02 * took, (added, took)


def test_a_preempted_run_and_its_resume_each_say_where_their_wall_time_went(tmp_path, monkeypatch):
    """SIGTERM as step 25 begins (evaluations and checkpoints before it): the preempted run's
    summary.json still breaks its wall time down, as does the resumed run's."""
    import json
    import time

    import pytest

    from runner.errors import Preempted
    from runner.run import run
    from tests.helpers import TINY_MLP, make_cfg
    from tests.test_signals import signal_in_step

    overrides = [
        *TINY_MLP,
        "trainer.max_steps=40",
        "trainer.log_every_n_steps=5",
        "trainer.val_check_interval=10",
        "trainer.checkpoint_every_n_steps=10",
        f"cache_dir={tmp_path / 'cache'}",
    ]
    signal_in_step(monkeypatch, 25, "SIGTERM")
    cfg = make_cfg(*overrides)
    start = time.time()
    with pytest.raises(Preempted):
        run(cfg, tmp_path / "run")
    monkeypatch.undo()
    stopped = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert stopped["status"] == "preempted"
    _adds_up(stopped["wall_time"], start, tmp_path / "run")
    assert stopped["wall_time"]["evaluation_s"] > 0 and stopped["wall_time"]["checkpoints_s"] > 0
    cfg = make_cfg(*overrides, "trainer.resume=auto")
    start = time.time()
    resumed = run(cfg, tmp_path / "run")
    _adds_up(resumed["wall_time"], start, tmp_path / "run")


def test_more_cpu_threads_than_cores_is_said_in_one_line(capsys):
    """trainer.cpu_threads over the cores this process may use (1000 on any machine here): the
    run keeps the count it was given (a match bit for bit with a larger machine's may want it)
    and says in one line that its threads outnumber its cores, which contends with itself."""
    import torch

    from runner.measure.contention import usable_cores
    from runner.train.threads import Threads

    cores = usable_cores()
    threads = Threads()
    try:
        got = threads.fit(cores + 1, torch.device("cpu"))
    finally:
        threads.restore()
    assert got["cpu_threads"] == cores + 1
    said = " ".join(capsys.readouterr().err.split())
    assert f"trainer.cpu_threads={cores + 1} is more than the {cores} cores" in said
    threads = Threads()
    try:
        threads.fit(1, torch.device("cpu"))
    finally:
        threads.restore()
    assert "is more than" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "verdicts, want",
    [
        ([None, None], None),
        ([None, False], False),
        ([False, False], False),
        ([None, True], True),
        ([False, True], True),
        ([True, True], True),
    ],
)
def test_an_interleaved_timing_is_contended_clean_or_could_not_tell(verdicts, want):
    from runner.compare.interleave import _contended

    assert _contended(verdicts) is want


def test_interleaved_rounds_too_short_to_judge_say_so(capsys, monkeypatch):
    """Rounds too short to judge (every window under MIN_WINDOW_S, set here past any round):
    the figures say the contention could not be told (None), not that the rounds were clean
    (they read False before), and the sweep's line says how to time longer."""
    from runner.compare import interleave
    from runner.measure import contention
    from tests.helpers import TINY_MLP, make_cfg

    monkeypatch.setattr(contention, "MIN_WINDOW_S", 1e9)
    configs = {
        k: make_cfg(*TINY_MLP, f"precision={k}", "trainer.max_steps=50") for k in ("fp32", "bf16")
    }
    figures = interleave.time_configs(configs, 2, 1)
    assert [f["speed_contended"] for f in figures.values()] == [None, None]
