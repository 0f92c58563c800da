"""Where a run's wall time went (issue 49): summary.json's `wall_time` breaks the run into
startup, the audited step, warm-up and steady steps, evaluation, checkpoints, logging and
teardown, which add up to the wall time a clock around the run reads (within 2%)."""

from __future__ import annotations

import time

from runner.run import run
from tests.helpers import TINY_MLP, make_cfg

PHASES = (
    "startup_s",
    "audited_step_s",
    "warmup_steps_s",
    "steady_steps_s",
    "evaluation_s",
    "checkpoints_s",
    "logging_s",
    "teardown_s",
)


def until_summary(started: float, folder) -> float:
    """Seconds from `started` (time.time()) to the writing of the run's summary.json (its
    modification time): the span the breakdown covers, to the summary's last figure. Its fsync
    and the printed table come after it."""
    return (folder / "summary.json").stat().st_mtime_ns / 1e9 - started


def test_the_wall_time_breakdown_adds_up_to_the_runs_wall_time(tmp_path, capsys):
    cfg = make_cfg(
        *TINY_MLP,
        "model.hidden_size=256",
        "dataset.batch_size=128",
        "trainer.max_steps=60",
        "trainer.log_every_n_steps=10",
        "trainer.val_check_interval=20",
        "trainer.checkpoint_every_n_steps=30",
        f"cache_dir={tmp_path}",
    )
    start = time.time()
    s = run(cfg, tmp_path / "run")
    took = until_summary(start, tmp_path / "run")
    wall = s["wall_time"]
    assert set(PHASES) <= wall.keys() and all(wall[k] >= 0 for k in PHASES)
    for phase in ("audited_step_s", "steady_steps_s", "evaluation_s", "checkpoints_s"):
        assert wall[phase] > 0, phase  # each measured where the run had it
    added = sum(wall[k] for k in PHASES)
    assert abs(added - took) <= 0.02 * took, (added, took)
    assert wall["total_s"] == added or abs(wall["total_s"] - added) < 1e-6
    assert wall["startup_parts"]["imports_s"] == 0  # a run called from Python starts there
    printed = " ".join(capsys.readouterr().out.split())
    # the printed line names the phases over 0.05 s: an in-process run's startup may be under
    assert f"wall time {wall['total_s']:.1f} s: " in printed and "steady steps" in printed
