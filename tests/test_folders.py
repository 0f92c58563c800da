"""A job folder is one run (one config, one writer, one W&B run) and a sweep folder one sweep
(runner/folders.py); every run-output file is written whole or not at all (runner/files.py).
In-process runs; the real command line's reruns and concurrent commands: tests/e2e/test_reruns.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.compare.jobs import load_sweep, others_line
from runner.errors import UserError
from runner.files import replacing, write_text
from runner.run import run
from tests.helpers import TINY_MLP, make_cfg, read_metrics

STEPS = [*TINY_MLP, "trainer.val_check_interval=0", "trainer.checkpoint_every_n_steps=2"]


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` but its lock, by relative path: what a refusal must leave."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def test_an_unfinished_run_resumed_with_another_value_is_refused_before_anything_is_written(
    tmp_path,
):
    run(make_cfg(*STEPS, "trainer.max_steps=4"), tmp_path)
    before = files_of(tmp_path)
    with pytest.raises(UserError) as e:
        run(
            make_cfg(
                *STEPS, "trainer.max_steps=8", "trainer.resume=auto", "optim.optimizer.lr=0.1"
            ),
            tmp_path,
        )
    said = str(e.value)
    assert "holds a run stopped at step 4 with other values" in said
    assert "optim.optimizer.lr=0.1 (it ran: 0.001)" in said and "\n" not in said
    assert files_of(tmp_path) == before
    # the same values continue it; a longer run (trainer.max_steps) is the same run
    assert (
        run(make_cfg(*STEPS, "trainer.max_steps=8", "trainer.resume=auto"), tmp_path)["steps"] == 8
    )


def test_a_run_killed_before_its_first_checkpoint_is_held_to_its_values_too(tmp_path):
    """No checkpoint holds its config: the folder's record (run.json) does, from the start."""
    run(make_cfg(*STEPS, "trainer.max_steps=1", "trainer.checkpoint_every_n_steps=0"), tmp_path)
    for path in (tmp_path / "checkpoints").iterdir():
        path.unlink()
    (tmp_path / "summary.json").unlink()  # as a kill leaves it: rows, no checkpoint, no summary
    with pytest.raises(UserError, match=r"model.hidden_size=32 \(it ran: 64\)"):
        run(
            make_cfg(*STEPS, "trainer.max_steps=1", "trainer.resume=auto", "model.hidden_size=32"),
            tmp_path,
        )


def test_resume_across_precision_may_change_the_precision_and_nothing_else(tmp_path):
    run(make_cfg(*STEPS, "trainer.max_steps=2"), tmp_path)
    across = [
        *STEPS,
        "trainer.max_steps=4",
        "trainer.resume=auto",
        "trainer.resume_across_precision=true",
    ]
    with pytest.raises(UserError, match=r"model.hidden_size=32 \(it ran: 64\)"):
        run(make_cfg(*across, "precision=bf16", "model.hidden_size=32"), tmp_path)
    assert run(make_cfg(*across, "precision=bf16"), tmp_path)["precision"] == "bf16"
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["config"]["precision"]["mode"] == "bf16"  # the folder's run goes on in bf16


def test_the_wandb_run_id_is_in_the_folder_from_the_start_and_kept(tmp_path):
    run(make_cfg(*STEPS, "trainer.max_steps=1", "trainer.checkpoint_every_n_steps=0"), tmp_path)
    first = json.loads((tmp_path / "run.json").read_text())["wandb_run_id"]
    assert len(first) == 8
    (tmp_path / "checkpoints" / "last.pt").unlink()  # killed before any checkpoint
    (tmp_path / "summary.json").unlink()
    run(make_cfg(*STEPS, "trainer.max_steps=2", "trainer.resume=auto"), tmp_path)
    assert json.loads((tmp_path / "run.json").read_text())["wandb_run_id"] == first
    other = tmp_path / "other"  # another folder is another run, resumed from this one's weights
    run(
        make_cfg(*STEPS, "trainer.max_steps=3", f"trainer.resume={tmp_path}/checkpoints/last.pt"),
        other,
    )
    assert json.loads((other / "run.json").read_text())["wandb_run_id"] != first


def test_a_torn_metrics_line_is_cut_on_resume_and_said(tmp_path, capsys):
    run(make_cfg(*STEPS, "trainer.max_steps=4", "trainer.log_every_n_steps=1"), tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + '{"step": 5, "loss": 0.')  # a kill mid-write
    (tmp_path / "summary.json").unlink()
    summary = run(
        make_cfg(
            *STEPS, "trainer.max_steps=6", "trainer.log_every_n_steps=1", "trainer.resume=auto"
        ),
        tmp_path,
    )
    assert summary["status"] == "completed"
    said = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert "a line torn by a kill while it was written: cut there, the 4 whole rows" in said
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_temporary_files_a_killed_writer_left_are_removed(tmp_path, capsys):
    run(make_cfg(*STEPS, "trainer.max_steps=2"), tmp_path)
    stale = [tmp_path / "checkpoints" / ".last.pt.99999.tmp", tmp_path / ".summary.json.99999.tmp"]
    for path in stale:
        path.write_bytes(b"half a file")
    run(make_cfg(*STEPS, "trainer.max_steps=4", "trainer.resume=auto"), tmp_path)
    assert not any(p.exists() for p in stale)
    assert ".last.pt.99999.tmp" in " ".join(capsys.readouterr().err.split())


def holding(folder: Path) -> subprocess.Popen:
    """Another process that holds `folder`'s lock (it prints "held" once it does)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from runner import folders; "
            "folders.hold(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)",
            str(folder),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_folder_another_process_writes_is_refused_naming_that_process(tmp_path):
    holder = holding(tmp_path)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"is in use by process {holder.pid} on "):
            run(make_cfg(*STEPS, "trainer.max_steps=1"), tmp_path)
        assert not (tmp_path / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    assert run(make_cfg(*STEPS, "trainer.max_steps=1"), tmp_path)["status"] == "completed"


def job_folder(sweep: Path, name: str, precision: str, status: str, sweep_id: str | None) -> None:
    folder = sweep / name
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(f"precision:\n  mode: {precision}\nseed: 0\n")
    (folder / ".hydra" / "overrides.yaml").write_text(f"- precision={precision}\n")
    summary = {"status": status, "precision": precision, "final_loss": 1.0, "steps": 4}
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 5))
    )
    if sweep_id:
        (folder / "run.json").write_text(json.dumps({"sweep": sweep_id}))


def test_the_comparison_reads_only_its_sweeps_jobs_and_names_the_others(tmp_path):
    (tmp_path / "sweep.json").write_text(json.dumps({"id": "now"}))
    job_folder(tmp_path, "0", "fp32", "completed", "now")
    job_folder(tmp_path, "1", "bf16", "completed", "now")
    job_folder(tmp_path, "2", "fp16", "failed", "before")  # a stale failed job of another command
    jobs = load_sweep(tmp_path)
    assert [j.folder.name for j in jobs] == ["0", "1"]
    line = others_line(tmp_path)
    assert line.startswith("not part of this sweep") and "2 (precision=fp16)" in line
    (tmp_path / "sweep.json").unlink()  # a folder from before sweeps had an identity: all of it
    assert [j.folder.name for j in load_sweep(tmp_path)] == ["0", "1", "2"]


def test_an_unreadable_summary_makes_its_job_failed_and_named(tmp_path):
    job_folder(tmp_path, "0", "fp32", "completed", None)
    job_folder(tmp_path, "1", "bf16", "completed", None)
    summary = tmp_path / "1" / "summary.json"
    summary.write_text(summary.read_text()[:20])  # torn
    metrics = tmp_path / "0" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 5, "lo')  # torn last line
    jobs = load_sweep(tmp_path)
    assert jobs[1].summary == {"status": "failed", "error": "summary.json unreadable"}
    assert [r["step"] for r in jobs[0].rows] == [1, 2, 3, 4]
    compare = subprocess.run(
        [sys.executable, "-m", "runner.compare", str(tmp_path)], capture_output=True, text=True
    )
    assert "Traceback" not in compare.stderr, compare.stderr
    assert "summary.json unreadable" in (tmp_path / "compare.md").read_text()


def test_a_lock_is_dropped_with_its_process(tmp_path):
    """A killed writer never leaves its folder locked: the kernel drops the lock."""
    holder = holding(tmp_path)
    assert holder.stdout.readline().strip() == "held"
    os.kill(holder.pid, 9)
    holder.wait()
    time.sleep(0.1)
    assert run(make_cfg(*STEPS, "trainer.max_steps=1"), tmp_path)["status"] == "completed"


def test_a_file_written_whole_or_not_at_all(tmp_path):
    """A writer that fails midway (a kill, a full disk) leaves the previous file, and no
    temporary file once the next writer takes the folder."""
    path = tmp_path / "summary.json"
    write_text(path, '{"status": "completed"}\n')
    with pytest.raises(OSError), replacing(path) as f:
        f.write('{"status": "fai')
        raise OSError("no space left on device")
    assert json.loads(path.read_text()) == {"status": "completed"}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_every_run_output_file_goes_through_the_whole_file_writer():
    """runner/ writes files only through runner/files.py (or torch's checkpoint writer, itself
    through it, and metrics.jsonl's append, cut back to whole rows on resume)."""
    root = Path(__file__).resolve().parents[1] / "runner"
    direct = [
        f"{p.relative_to(root)}:{n}"
        for p in root.rglob("*.py")
        if p.name != "files.py"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if ".write_text(" in line or ".write_bytes(" in line
    ]
    assert direct == [], direct


def test_a_file_system_without_locks_is_said_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """Some network mounts refuse flock (ENOLCK): the run goes on, and says it holds no lock."""
    import errno

    from runner import folders

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(folders.fcntl, "flock", no_locks)
    assert run(make_cfg(*STEPS, "trainer.max_steps=1"), tmp_path)["status"] == "completed"
    said = " ".join(capsys.readouterr().err.split())
    assert "no lock here (No locks available): one command at a time" in said
