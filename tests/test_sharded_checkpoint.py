"""Sharded checkpoint sets (FSDP's, in torch.distributed.checkpoint's format) on disk: found whole
or skipped by name, and read without running pickled code. One process writes the sets here;
tests/test_distributed.py writes and resumes them with real ranks."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from runner.errors import UserError
from runner.run import run
from runner.train import checkpoint, sharded
from tests.helpers import TINY_MLP, make_cfg


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def _write_set(run_dir, name: str, step: int, poison_lr: bool = False) -> torch.nn.Module:
    """A set laid out as the Checkpointer writes one: state.pt, then DCP's shards and commit.
    Returns the model saved."""
    folder = run_dir / "checkpoints" / name
    checkpoint.save(folder / "state.pt", {"step": step, "shards": 1})
    model, optimizer = _trained()
    modules = sharded.module_states(model, [optimizer])
    if poison_lr:  # the optimizer's hyperparameters are pickled, not stored as tensors
        modules["optimizer"]["param_groups"][0]["lr"] = _Payload()
    sharded.save(folder, modules, distributed=False)
    return model


def test_resume_auto_takes_the_newest_whole_set_and_names_the_incomplete_one(tmp_path, capsys):
    for name, step in (("step-2", 2), ("step-4", 4), ("last-5", 5)):
        _write_set(tmp_path, name, step)
    (tmp_path / "checkpoints" / "last-5" / ".metadata").unlink()  # killed before the commit
    path, state = checkpoint.find_resume("auto", tmp_path)
    assert path.name == "step-4" and state["step"] == 4 and state["set"] == path
    assert "skipping last-5: checkpoint" in capsys.readouterr().err


def test_a_set_whose_metadata_carries_code_is_refused_not_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _write_set(tmp_path, "step-2", 2)
    metadata = tmp_path / "checkpoints" / "step-2" / ".metadata"
    metadata.write_bytes(pickle.dumps(_Payload()))
    assert checkpoint.find_resume("auto", tmp_path) is None  # skipped: nothing else to resume
    assert "skipping step-2" in capsys.readouterr().err
    cfg = make_cfg(*TINY_MLP, "trainer.strategy=ddp", f"trainer.resume={metadata.parent}")
    with pytest.raises(UserError, match=r"cannot be loaded safely: posix\.system is not ") as e:
        run(cfg, tmp_path / "run")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "pwned").exists()


def test_a_set_whose_optimizer_values_carry_code_is_refused_not_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_set(tmp_path, "step-2", 2, poison_lr=True)
    model, optimizer = _trained()
    with pytest.raises(UserError, match="does not fit this run: Weights only load failed"):
        sharded.load(tmp_path / "checkpoints" / "step-2", model, [optimizer])
    assert not (tmp_path / "pwned").exists()


def test_a_whole_set_loads_into_one_process(tmp_path):
    saved_model = _write_set(tmp_path, "step-2", 2)
    saved = checkpoint.load(tmp_path / "checkpoints" / "step-2")
    model, optimizer = _trained()  # other initial weights
    sharded.load(saved["set"], model, [optimizer])
    assert saved["step"] == 2
    for name, tensor in saved_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_a_set_into_fp16_master_is_one_clear_error(tmp_path):
    """fp16_master's optimizer holds fp32 copies of the weights, which a set does not name."""
    _write_set(tmp_path, "step-2", 2)
    model, _ = _trained()
    copies = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    with pytest.raises(UserError, match="cannot resume precision=fp16_master"):
        sharded.load(tmp_path / "checkpoints" / "step-2", model, [torch.optim.AdamW(copies)])
