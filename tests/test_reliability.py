"""Broken checkpoints, hostile payloads, mismatched configs, full disks, and non-finite values."""

from __future__ import annotations

import errno
import json
import os
import pickle

import pytest
import torch

from runner.errors import TrainingStopped, UserError
from runner.run import run
from runner.train import checkpoint
from tests.helpers import TINY_BERT, TINY_MLP, load_last, make_cfg, read_metrics

SHORT = [*TINY_MLP, "trainer.max_steps=6", "trainer.checkpoint_every_n_steps=2"]


@pytest.fixture
def trained(tmp_path):
    run(make_cfg(*SHORT), tmp_path)
    return tmp_path


def test_resume_auto_starts_fresh_without_a_checkpoint(tmp_path):
    summary = run(make_cfg(*SHORT, "trainer.resume=auto"), tmp_path)
    assert summary["steps"] == 6 and len(read_metrics(tmp_path)) == 6


def test_only_the_last_k_step_checkpoints_are_kept(tmp_path):
    run(
        make_cfg(
            *TINY_MLP,
            "trainer.max_steps=12",
            "trainer.checkpoint_every_n_steps=2",
            "trainer.keep_last_k=2",
        ),
        tmp_path,
    )
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["last.pt", "step-10.pt", "step-12.pt"]


def test_a_truncated_checkpoint_is_one_clear_error(trained):
    path = trained / "checkpoints" / "last.pt"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(UserError, match="cannot be loaded safely"):
        run(make_cfg(*SHORT, "trainer.max_steps=8", f"trainer.resume={path}"), trained)


def test_resume_auto_skips_a_damaged_checkpoint_for_the_newest_valid_one(
    trained, capsys, counted_loads
):
    (trained / "checkpoints" / "last.pt").write_bytes(b"garbage")
    (trained / "checkpoints" / "step-6.pt").write_bytes(b"")
    summary = run(make_cfg(*SHORT, "trainer.max_steps=8", "trainer.resume=auto"), trained)
    err = capsys.readouterr().err
    assert "resumed from" in err
    assert "skipping last.pt" in err and "skipping step-6.pt" in err
    assert counted_loads == ["last.pt", "step-6.pt", "step-4.pt"]  # step-2.pt is never read
    rows = read_metrics(trained)
    assert [r["step"] for r in rows] == list(range(1, 9)) and summary["steps"] == 8


@pytest.fixture
def counted_loads(monkeypatch):
    """checkpoint.load, recording the name of every file it reads."""
    real, names = checkpoint.load, []

    def load(path):
        names.append(path.name)
        return real(path)

    monkeypatch.setattr(checkpoint, "load", load)
    return names


def _write_checkpoints(folder, **steps: int) -> None:
    """Small stand-ins for checkpoints: file stem (step_6 for step-6) → the step stored inside."""
    for stem, step in steps.items():
        path = folder / "checkpoints" / f"{stem.replace('_', '-')}.pt"
        checkpoint.save(path, {"model": {}, "optimizer": {}, "step": step})


def test_resume_auto_reads_only_the_newest_checkpoint_when_it_loads(tmp_path, counted_loads):
    _write_checkpoints(tmp_path, last=12, step_8=8, step_10=10, step_12=12)
    (tmp_path / "checkpoints" / "last.shard1.pt").write_bytes(b"garbage")
    path, state = checkpoint.find_resume("auto", tmp_path)
    assert path.name == "last.pt" and state["step"] == 12
    assert counted_loads == ["last.pt"]


def test_resume_auto_orders_step_files_by_number_and_skips_shards(tmp_path, counted_loads, capsys):
    _write_checkpoints(tmp_path, step_2=2, step_9=9, step_10=10)
    (tmp_path / "checkpoints" / "step-10.shard1.pt").write_bytes(b"garbage")
    path, state = checkpoint.find_resume("auto", tmp_path)
    assert path.name == "step-10.pt" and state["step"] == 10  # 10 after 9, not as text
    assert counted_loads == ["step-10.pt"]
    counted_loads.clear()
    (tmp_path / "checkpoints" / "step-10.pt").write_bytes(b"")
    path, state = checkpoint.find_resume("auto", tmp_path)
    assert path.name == "step-9.pt" and state["step"] == 9
    assert counted_loads == ["step-10.pt", "step-9.pt"]
    assert "skipping step-10.pt" in capsys.readouterr().err


def test_resume_auto_prefers_a_step_file_written_after_last(tmp_path, counted_loads):
    """A crash between writing step-12.pt and last.pt leaves last.pt one checkpoint behind."""
    _write_checkpoints(tmp_path, last=10, step_10=10, step_12=12)
    path, state = checkpoint.find_resume("auto", tmp_path)
    assert path.name == "step-12.pt" and state["step"] == 12
    assert counted_loads == ["last.pt", "step-12.pt"]


def test_resume_auto_with_nothing_that_loads_starts_fresh(tmp_path, counted_loads, capsys):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"garbage")
    (tmp_path / "checkpoints" / "step-4.pt").write_bytes(b"")
    assert checkpoint.find_resume("auto", tmp_path) is None
    assert counted_loads == ["last.pt", "step-4.pt"]
    assert "skipping step-4.pt" in capsys.readouterr().err


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_checkpoint_carrying_code_is_refused_not_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pt"
    torch.save({"model": _Payload(), "optimizer": {}, "step": 1}, path, pickle_module=pickle)
    with pytest.raises(UserError, match="cannot be loaded safely"):
        checkpoint.load(path)
    assert not (tmp_path / "pwned").exists()


def test_resuming_a_different_model_names_the_mismatch(trained):
    """From another folder's checkpoint (in its own folder, a changed value is refused before:
    tests/test_folders.py)."""
    last = trained / "checkpoints" / "last.pt"
    cfg = make_cfg(*SHORT, "model.hidden_size=32", f"trainer.resume={last}", "trainer.max_steps=8")
    with pytest.raises(
        UserError, match=r"does not fit this model config: .*size mismatch for net\.0\.weight"
    ):
        run(cfg, trained / "other")


def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(trained, monkeypatch):
    before = (trained / "checkpoints" / "last.pt").read_bytes()
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    cfg = make_cfg(*SHORT, "trainer.max_steps=10", "trainer.resume=auto")
    with pytest.raises(
        UserError, match="No space left on device; the previous checkpoint is intact"
    ):
        run(cfg, trained)
    monkeypatch.undo()
    assert (trained / "checkpoints" / "last.pt").read_bytes() == before
    assert not list((trained / "checkpoints").glob(".*tmp"))
    assert load_last(trained)["step"] == 6
    assert json.loads((trained / "summary.json").read_text())["status"] == "failed"


def test_checkpoints_hold_everything_needed_to_resume(trained):
    state = load_last(trained)
    assert {
        "model",
        "optimizer",
        "scaler",
        "scheduler",
        "step",
        "samples_seen",
        "rng",
        "config",
        "wandb_run_id",
    } <= set(state)
    assert set(state["rng"]) == {"python", "numpy", "torch", "cuda"}
    assert state["config"]["trainer"]["max_steps"] == 6


def test_fp16_overflow_stops_with_a_report_naming_modules_while_bf16_is_finite(tmp_path):
    """A BERT initialised with huge weights overflows fp16's range in the forward pass."""
    big = [
        *TINY_BERT,
        "model.initializer_range=300",
        "trainer.max_steps=30",
        "trainer.max_consecutive_nonfinite=4",
        "trainer.log_every_n_steps=1",
    ]
    with pytest.raises(TrainingStopped, match="4 steps in a row had non-finite") as err:
        run(make_cfg(*big, "precision=fp16"), tmp_path / "fp16")
    assert "try precision=bf16" in str(err.value)
    report = json.loads((tmp_path / "fp16" / "nonfinite.json").read_text())
    assert report["step"] == 1 and report["precision"] == "fp16"
    first = report["forward"]["first_nonfinite"]
    assert first and first.startswith("model.bert.")
    assert float(report["forward"]["largest"][0][1]) > 65504  # JSON writes inf as "inf"
    assert report["loss_scale_history"][0][2] is True
    rows = read_metrics(tmp_path / "fp16")
    assert len(rows) == 4 and all(r["skipped"] for r in rows)
    assert not (tmp_path / "fp16" / "checkpoints").exists()
    bf16 = run(make_cfg(*big, "precision=bf16", "trainer.max_steps=3"), tmp_path / "bf16")
    assert bf16["skipped_steps"] == 0 and bf16["final_loss"] == bf16["final_loss"]  # finite


def test_a_diverging_fp32_run_skips_bad_updates_then_stops_with_a_report(tmp_path):
    cfg = make_cfg(
        *TINY_MLP,
        "optim.optimizer.lr=1e5",
        "trainer.gradient_clip_val=null",
        "trainer.max_steps=200",
        "trainer.max_consecutive_nonfinite=3",
    )
    with pytest.raises(TrainingStopped, match="3 steps in a row") as err:
        run(cfg, tmp_path)
    assert "lower the learning rate" in str(err.value)
    rows = read_metrics(tmp_path)
    first_bad = next(r for r in rows if r["skipped"])
    report = json.loads((tmp_path / "nonfinite.json").read_text())
    assert report["step"] == first_bad["step"] and report["precision"] == "fp32"
    assert report["gradients"]["largest"] or report["forward"]["largest"]
    assert rows[-1]["skipped_total"] == 3 and [r["skipped"] for r in rows[-3:]] == [True] * 3
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "steps in a row" in summary["error"]
