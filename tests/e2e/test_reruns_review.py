"""Reruns that must not mix runs, as an independent review tried to break them (issue 45): a
longer run over a decayed schedule, a default spelled out, the same jobs in new folders, a
finished run relabelled, a single run in a sweep's job folder, torn .hydra/ files. Each test
failed before its fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_reruns import ENV as E2E_ENV
from tests.e2e.test_reruns import SMALL as RERUN_SMALL
from tests.helpers import cli, read_metrics

pytestmark = pytest.mark.slow

ENV = E2E_ENV | {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
SMALL = [a for a in RERUN_SMALL if not a.startswith("trainer.checkpoint")]


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    flags = [a for a in args if a == "-m"]  # Hydra's -m before the overrides
    return cli(*flags, *SMALL, *(a for a in args if a != "-m"), cwd=tmp_path, env=ENV)


def compare_cli(tmp_path: Path, folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runner.compare", str(folder)],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def rows(folder: Path) -> list[dict]:
    return json.loads((folder / "compare.json").read_text())


def test_a_longer_max_steps_on_rerun_does_not_splice_two_lr_schedules(tmp_path):
    """trainer.max_steps is a RERUN_KEY ("a longer run continues"), but it is the length of the
    LR schedule (20 warm-up steps, then cosine to max_steps): a 40-step run continued to 80 trains
    steps 21-40 decayed to the minimum (1e-4), then jumps back up (7.5e-4 at step 42), recorded
    as an 80-step run. Accepted, its lr must be an 80-step run's (else refuse, exit 2)."""
    folder = tmp_path / "run"
    first = run_cli(tmp_path, "trainer.max_steps=40", f"hydra.run.dir={folder}")
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli(
        tmp_path, "trainer.max_steps=80", "trainer.resume=auto", f"hydra.run.dir={folder}"
    )
    if again.returncode == 2:
        return  # refused: fine
    assert again.returncode == 0, again.stderr[-2000:]
    fresh = run_cli(tmp_path, "trainer.max_steps=80", f"hydra.run.dir={tmp_path / 'fresh'}")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    spliced = [r["lr"] for r in read_metrics(folder)]
    straight = [r["lr"] for r in read_metrics(tmp_path / "fresh")]
    assert spliced == pytest.approx(straight), (
        "the continued run's lr is not an 80-step run's: "
        f"steps 39-42 {spliced[38:42]} vs {straight[38:42]}"
    )


def test_a_sweep_rerun_that_spells_out_a_default_value_is_not_another_sweep(tmp_path):
    """The sweep's pre-check compares override text: `seed=0` (the default) over jobs that ran
    without it is refused as "asks seed=0 (it ran: (unset))", though every job's resolved config
    is the same (a single run with trainer.resume=auto accepts it)."""
    sweep = f"hydra.sweep.dir={tmp_path / 'sweep'}"
    first = run_cli(tmp_path, "-m", "precision=fp32", "trainer.max_steps=10", sweep)
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli(tmp_path, "-m", "precision=fp32", "trainer.max_steps=10", "seed=0", sweep)
    assert again.returncode == 0, [
        line for line in again.stderr.splitlines() if line.startswith("error")
    ]


def test_the_same_jobs_in_new_job_folders_are_not_counted_as_more_seeds(tmp_path):
    """The same command again with another hydra.sweep.subdir (its job folders all new: they
    join the folder's sweep) runs the same seed again; the comparison counts it as a second
    seed of the row ("2 seeds, 1.8780 ± 0.0000"), a seed spread of zero."""
    sweep = tmp_path / "sweep"
    args = ["-m", "precision=fp32", "trainer.max_steps=10", f"hydra.sweep.dir={sweep}"]
    first = run_cli(tmp_path, *args)
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli(tmp_path, *args, "hydra.sweep.subdir=again${hydra.job.num}")
    if again.returncode == 2:
        return  # refused: fine
    (row,) = rows(sweep)
    assert row["seeds"] == 1, f"one seed ran twice, compared as {row['seeds']} seeds: {row['jobs']}"


def test_a_finished_run_is_not_relabelled_by_resume_across_precision(tmp_path):
    """A completed fp32 run, rerun with precision=bf16 trainer.resume_across_precision=true
    (nothing runs: "the run had finished"): its record must keep saying fp32, as its
    summary.json does (it used to be relabelled bf16)."""
    folder = tmp_path / "run"
    first = run_cli(tmp_path, "trainer.max_steps=10", f"hydra.run.dir={folder}")
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli(
        tmp_path,
        "trainer.max_steps=10",
        "precision=bf16",
        "trainer.resume=auto",
        "trainer.resume_across_precision=true",
        f"hydra.run.dir={folder}",
    )
    if again.returncode == 2:
        return  # refused: fine
    summary = json.loads((folder / "summary.json").read_text())
    record = json.loads((folder / "run.json").read_text())
    assert record["config"]["precision"]["mode"] == summary["precision"], (
        f"run.json says {record['config']['precision']['mode']}, summary.json {summary['precision']}"
    )


def test_a_single_run_in_a_sweep_job_folder_keeps_the_job_in_its_sweep(tmp_path):
    """`hydra.run.dir=<sweep>/0 trainer.resume=auto` with the job's own values (to see it, or
    while the sweep still runs) is accepted and must leave the job in its sweep (it used to set
    run.json's sweep to null, and the comparison dropped the fp32 baseline)."""
    sweep = tmp_path / "sweep"
    first = run_cli(
        tmp_path, "-m", "precision=fp32,bf16", "trainer.max_steps=10", f"hydra.sweep.dir={sweep}"
    )
    assert first.returncode == 0, first.stderr[-2000:]
    single = run_cli(
        tmp_path,
        "precision=fp32",
        "trainer.max_steps=10",
        "trainer.resume=auto",
        f"hydra.run.dir={sweep / '0'}",
    )
    assert single.returncode in (0, 2), single.stderr[-2000:]
    compared = compare_cli(tmp_path, sweep)
    assert "not part of this sweep" not in compared.stdout + compared.stderr
    assert sorted(r["label"] for r in rows(sweep)) == ["bf16", "fp32"]


def test_an_unreadable_overrides_yaml_is_one_line_not_a_callback_warning(tmp_path):
    """A job's .hydra/overrides.yaml cut short: the sweep's pre-check raises a parse error,
    Hydra prints `UserWarning: Callback CompareCallback.on_multirun_start raised
    OverrideParseException: ...` and the sweep runs on unchecked, exit 0."""
    sweep = tmp_path / "sweep"
    args = ["-m", "precision=fp32", "trainer.max_steps=10", f"hydra.sweep.dir={sweep}"]
    first = run_cli(tmp_path, *args)
    assert first.returncode == 0, first.stderr[-2000:]
    overrides = sweep / "0" / ".hydra" / "overrides.yaml"
    overrides.write_text(overrides.read_text()[:30])
    again = run_cli(tmp_path, *args)
    text = again.stdout + again.stderr
    assert "raised" not in text and "Traceback" not in text, text[-1500:]


def test_an_unreadable_hydra_config_is_named_not_a_traceback(tmp_path):
    """A job folder's .hydra/config.yaml cut short (here another command's job, kept in the
    folder): the sweep's end is Hydra's `UserWarning: Callback CompareCallback.on_multirun_end
    raised ScannerError`, exit 0, and `python -m runner.compare` a traceback."""
    sweep = tmp_path / "sweep"
    args = ["-m", "precision=fp32", "trainer.max_steps=10", f"hydra.sweep.dir={sweep}"]
    first = run_cli(tmp_path, *args)
    assert first.returncode == 0, first.stderr[-2000:]
    other = sweep / "7"
    (other / ".hydra").mkdir(parents=True)
    config = (sweep / "0" / ".hydra" / "config.yaml").read_text()
    (other / ".hydra" / "config.yaml").write_text(config[:200])
    (other / "run.json").write_text(json.dumps({"sweep": "another"}))
    compared = compare_cli(tmp_path, sweep)
    assert "Traceback" not in compared.stderr, compared.stderr[-1500:]
    again = run_cli(tmp_path, *args)
    assert "raised" not in again.stderr, again.stderr[-1500:]
