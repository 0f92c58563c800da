"""Hostile input on every path: one clear line (what, which value, what is allowed), exit 2, no
traceback, and nothing lost. Checked before the first job of a command line starts."""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.data import TensorDataset

from runner.config.preflight import preflight
from runner.errors import UserError
from runner.run import build, run
from tests.helpers import TINY_MLP, cli, make_cfg, read_metrics

MLP = ["model=mlp", "dataset.num_samples=256", "logger=none"]
BERT = ["model=bert", "dataset.num_documents=50", "logger=none"]


def eight_features() -> TensorDataset:
    """64 items of 8 features, 3 classes."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 8, generator=g), torch.arange(64) % 3)


@pytest.mark.parametrize(
    "args, message",
    [
        # values the constructors or numpy would meet with a traceback
        (
            [*MLP, "dataset.num_workers=-1"],
            "dataset.num_workers=-1 is invalid: must be an integer ≥ 0",
        ),
        (
            [*MLP, "dataset.num_samples=0"],
            "dataset.num_samples=0 is invalid: must be an integer ≥ 1",
        ),
        ([*MLP, "seed=-1"], "seed=-1 is invalid: must be an integer in [0, 2**32)"),
        ([*MLP, "seed=99999999999999999999"], "seed=99999999999999999999 is invalid: must be an"),
        # errors that named the constructor, not the key
        (
            [*BERT, "model.hidden_size=abc"],
            "model.hidden_size='abc' is invalid: must be an integer",
        ),
        (
            [*MLP, "dataset.batch_size=abc"],
            "dataset.batch_size='abc' is invalid: must be an integer",
        ),
        (
            [*MLP, "dataset.num_classes=0"],
            "dataset.num_classes=0 is invalid: must be an integer ≥ 1",
        ),
        ([*MLP, "dataset.validation_fraction=1.5"], "dataset.validation_fraction=1.5 is invalid"),
        ([*BERT, "model.hidden_size=30", "model.num_attention_heads=4"], "must be a multiple of"),
        ([*BERT, "dataset.seq_len=1024"], "dataset.seq_len=1024 is invalid: must be ≤ model.max_"),
        # accepted although invalid
        ([*MLP, "precision=fp16", "precision.grad_scaler.init_scale=inf"], "init_scale=inf is inv"),
        (
            [*MLP, "precision.grad_scaler.growth_factor=inf"],
            "growth_factor=inf is invalid: must be",
        ),
        ([*MLP, "precision.fp32_modules=['']"], "precision.fp32_modules=[''] is invalid: module"),
        (
            [*MLP, "optim.optimizer.fused=maybe"],
            "optim.optimizer.fused='maybe' is invalid: must be",
        ),
        (
            [*BERT, "dataset.vocab_size=0"],
            "dataset.vocab_size=0 is invalid: must be an integer ≥ 1",
        ),
        ([*BERT, "model.num_hidden_layers=-1"], "model.num_hidden_layers=-1 is invalid"),
        ([*MLP, "model.hidden_size=0"], "model.hidden_size=0 is invalid: must be an integer ≥ 1"),
        ([*MLP, "model.num_layers=-1"], "model.num_layers=-1 is invalid: must be an integer ≥ 1"),
        ([*MLP, "runner.summary=long"], "runner.summary='long' is invalid: short or full"),
        # keys that nothing would read, however they were added
        ([*MLP, "++trainer.max_stepz=5"], "trainer.max_stepz=5 is invalid: trainer has no key"),
        ([*MLP, "++precision.grad_scaler.patience=3"], "grad_scaler has no key 'patience'"),
        ([*MLP, "++model.widht=3"], "model.widht is not a key tasks.classification.MLPClassifier"),
        ([*MLP, "++foo=1"], "foo=1 is invalid: not a key (allowed: precision, trainer,"),
        # interpolations resolved before anything reads them
        ([*MLP, "trainer.max_steps=${oc.env:UNSET_VAR}"], "trainer.max_steps: cannot resolve it"),
        ([*MLP, "seed=${no.such.key}"], "cannot resolve it: Interpolation key 'no.such.key'"),
        # a sweep: every job checked before the first starts, devices and imports too
        (["-m", *MLP, "trainer.device=cpu,cuda:7"], "trainer.device=cuda:7 but CUDA is not"),
        ([*MLP, "optim.optimizer._target_=no.such.Optimizer"], "optim.optimizer._target_=no.such"),
        (
            [*MLP, "optim.optimizer._target_=torch.optim.Nope"],
            "_target_=torch.optim.Nope cannot be imported: No module named 'torch.optim.Nope'",
        ),
        # a task's own choices (its constructor's Literal annotation), in every job of a sweep
        (["-m", *MLP, "model.activation=gelu,relu"], "model.activation='relu' is invalid: allowed"),
        # a checkpoint that cannot be there, found before anything is built
        ([*MLP, f"trainer.resume=/tmp/{'x' * 300}.pt"], "no checkpoint there (File name too long)"),
        ([*MLP, "trainer.resume=/no/such/last.pt"], "is invalid: no checkpoint there: a path"),
        # messages that say what is allowed
        (
            [*MLP, "precision=staged", "precision.stages=[{mode:fp32,until:3},{mode:bf16}]"],
            "Key 'until' not in 'StageConfig' (allowed: mode, until_step)",
        ),
        ([*MLP, "precision.mode=bf16", "model.activation=gélu"], "(quote a value with spaces or"),
        ([*MLP, f"precision.mode={'x' * 5000}"], "x… (4882 more characters) is invalid"),
        # a value of the wrong type for its schema field, in the words of every other line
        (
            [*MLP, "trainer.compile=maybe"],
            "trainer.compile=maybe is invalid: must be true or false",
        ),
        ([*MLP, "trainer.max_steps=abc"], "trainer.max_steps=abc is invalid: must be an integer"),
        ([*MLP, "trainer.gradient_clip_val=x"], "gradient_clip_val=x is invalid: must be a number"),
        (
            [*MLP, "precision=nvfp4", "precision.fp4.sr=1.5"],
            "precision.fp4.sr=1.5 is invalid: must be true or false",
        ),
    ],
)
def test_a_hostile_value_is_one_line_naming_the_key_before_anything_runs(args, message):
    with pytest.raises(UserError) as e:
        preflight(args)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert len(str(e.value)) < 500  # a schema's keys listed: trainer has 20


def test_an_unimportable_target_is_said_once(caplog):
    """Not Hydra's error chain logged first ("Error getting object at ... Are you sure ...")."""
    with pytest.raises(UserError):
        preflight([*MLP, "optim.optimizer._target_=torch.optim.Nope"])
    assert [r.getMessage() for r in caplog.records if r.name.startswith("hydra")] == []


def test_a_finished_run_rerun_with_other_values_is_refused_and_left_as_it_was(tmp_path):
    """trainer.resume=auto on a finished run: its summary where the values are the run's; where
    they are not (a model, a precision), none would apply: refused, as an unfinished run's
    resume refuses a model or a precision its checkpoint does not fit."""
    steps = [*TINY_MLP, "trainer.max_steps=2", "trainer.val_check_interval=0"]
    run(make_cfg(*steps), tmp_path)
    files = ("summary.json", "metrics.jsonl", "checkpoints/last.pt")
    before = {name: (tmp_path / name).read_bytes() for name in files}
    for change, said in (
        ("model.hidden_size=32", "model.hidden_size=32 (it ran: 64) would not apply"),
        ("precision=fp16_master", "precision.mode=fp16_master (it ran: fp32)"),
    ):
        with pytest.raises(UserError, match=re.escape(said)) as e:
            run(make_cfg(*steps, "trainer.resume=auto", change), tmp_path)
        assert "is at step 2: the run had finished" in str(e.value)
    assert run(make_cfg(*steps, "trainer.resume=auto"), tmp_path)["steps"] == 2
    assert {name: (tmp_path / name).read_bytes() for name in files} == before


def test_a_path_through_a_file_is_refused_before_hydra_makes_its_folder(tmp_path):
    (tmp_path / "a_file").write_text("")
    for where in ("a_file", "a_file/run"):
        with pytest.raises(UserError, match=f"hydra.run.dir=.*{where} is invalid: .* is a file"):
            preflight([*MLP, f"hydra.run.dir={tmp_path / where}"])
    cache = make_cfg(*TINY_MLP, f"cache_dir={tmp_path / 'a_file'}")
    with pytest.raises(UserError, match="cache_dir=.* is invalid: must be a folder"):
        from runner.config.validation import validate

        validate(cache)


@pytest.mark.parametrize(
    "features, classes, message",
    [
        (
            5,
            3,
            "model.net (torch.nn.Linear) cannot take the dataset's items (a batch of 64: "
            "input [64, 8]): mat1 and mat2 shapes cannot be multiplied (64x8 and 5x3)",
        ),
        (
            8,
            2,
            "model.loss=cross_entropy: the dataset's targets reach class 2, but the net "
            "predicts 2 classes (0–1): give the net 3 outputs, or check the targets",
        ),
    ],
)
def test_data_the_net_cannot_take_is_one_line_at_build_time(features, classes, message):
    """One batch of the data goes through the user's net and the loss before training."""
    cfg = make_cfg(
        "model=module",
        "model.net._target_=torch.nn.Linear",
        f"+model.net.in_features={features}",
        f"+model.net.out_features={classes}",
        f"dataset.train._target_={__name__}.eight_features",
        "logger=none",
    )
    with pytest.raises(UserError) as e:
        build(cfg)
    assert str(e.value) == message


def test_a_failed_run_never_empties_an_earlier_runs_record(tmp_path):
    run(make_cfg(*TINY_MLP, "trainer.max_steps=2", "trainer.val_check_interval=0"), tmp_path)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    summary = (tmp_path / "summary.json").read_text()
    assert len(read_metrics(tmp_path)) == 2
    fresh = make_cfg(*TINY_MLP, "trainer.max_steps=3")
    unbuildable = make_cfg(
        "model=module", "model.net._target_=no.such.Net", "dataset.train._target_=no.such.data"
    )
    for cfg in (fresh, unbuildable):
        with pytest.raises(UserError, match="holds an earlier run's metrics.jsonl: continue it"):
            run(cfg, tmp_path)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert (tmp_path / "summary.json").read_text() == summary


def test_the_cli_says_one_line_and_exits_2(tmp_path):
    proc = cli(*MLP, "trainer.max_steps=${oc.env:UNSET_VAR}", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: trainer.max_steps: cannot")
