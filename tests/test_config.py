"""Bad input fails before anything runs, with one line that names the key and what is allowed."""

from __future__ import annotations

import pytest

from runner.config.commandline import expand
from runner.config.preflight import preflight
from runner.config.validation import validate
from runner.errors import UserError, first_line
from runner.run import build
from runner.train.optim import build_optimizers
from tests.helpers import TINY_MLP, make_cfg


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["precision=fp4"],
            "unknown precision 'fp4': choose from auto, bf16, bf16_true, fp16, fp16_master, fp32, "
            "fp8, mxfp4, mxfp8, nvfp4, staged, tf32",
        ),
        (
            ["model=gpt9"],
            "unknown model 'gpt9': choose from bert, bert_base, gan, gpt",
        ),
        (["-m", "precision=fp32,fp7"], "unknown precision 'fp7'"),
        (
            ["trainer.accumulate_grad_batches=0"],
            "trainer.accumulate_grad_batches=0 is invalid: must be ≥ 1",
        ),
        (["trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val=-1.0 is invalid"),
        (["trainer.max_steps=0"], "trainer.max_steps=0 is invalid: must be ≥ 1"),
        (["trainer.gradient_clip_algorithm=l3"], "allowed: norm, value"),
        (["trainer.device=tpu"], "trainer.device='tpu' is invalid"),
        (["trainer.max_stepz=3"], "Key 'max_stepz' not in 'TrainerConfig'"),
        (["trainer.max_steps=abc"], "trainer.max_steps=abc is invalid: must be an integer"),
        (["dataset=text_files"], "dataset.data_files is required"),
        (
            ["precision=fp16", "precision.grad_scaler.backoff_factor=2"],
            "backoff_factor=2.0 is invalid",
        ),
        (["-m", "precision=fp32,bf16", "trainer.max_steps=-3"], "trainer.max_steps=-3 is invalid"),
        (["trainer.strategy=horovod"], "trainer.strategy='horovod' is invalid: allowed: ddp, fsdp"),
        (
            ["trainer.strategy=fsdp", "precision=fp16_master"],
            "with trainer.strategy=fsdp use precision=fp16",
        ),
    ],
)
def test_preflight_rejects_bad_input_with_one_line(args, message):
    with pytest.raises(UserError) as err:
        preflight(args)
    text = str(err.value)
    assert message in text
    assert "\n" not in text


def test_preflight_accepts_good_sweeps():
    preflight(["-m", "precision=fp32,fp16,bf16", "model=bert", "trainer.max_steps=5"])
    preflight(["model=mlp", "dataset=blobs", "hydra.run.dir=/tmp/x"])


def test_expand_gives_one_override_list_per_job():
    jobs = expand(["-m", "precision=fp32,bf16", "trainer.max_steps=3,4", "seed=1"])
    assert len(jobs) == 4
    assert ["precision=fp32", "trainer.max_steps=3", "seed=1"] in jobs


def test_schema_types_are_enforced_at_compose_time():
    with pytest.raises(Exception, match="max_stepz"):
        make_cfg("trainer.max_stepz=3")


def test_model_picks_its_dataset_and_command_line_wins():
    assert make_cfg("model=mlp").dataset._target_.endswith("Blobs")
    assert make_cfg("model=bert").dataset._target_.endswith("GeneratedText")
    assert make_cfg("model=mlp", "dataset=synthetic_text").dataset._target_.endswith(
        "GeneratedText"
    )


def test_bert_base_has_the_real_size():
    m = make_cfg("model=bert_base").model
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.intermediate_size) == (
        768,
        12,
        12,
        3072,
    )


def test_defaults_validate():
    validate(make_cfg())


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.optimizer.lr=abc", "optim.optimizer.lr='abc' is invalid: must be a number > 0"),
        ("optim.optimizer.lr=-1", "optim.optimizer.lr=-1 is invalid: must be a number > 0"),
        ("optim.optimizer.betas=5", "optim.optimizer.betas=5 is invalid: must be a list of two"),
        ("optim.optimizer.betas=[0.9]", "optim.optimizer.betas=[0.9] is invalid"),
        ("optim.optimizer.betas=[0.9,1.0]", "optim.optimizer.betas=[0.9, 1.0] is invalid"),
        ("optim.optimizer.eps=0", "optim.optimizer.eps=0 is invalid: must be a number > 0"),
        ("optim.optimizer.weight_decay=-0.1", "optim.optimizer.weight_decay=-0.1 is invalid"),
        ("+optim.optimizer.momentum=1", "optim.optimizer.momentum=1 is invalid"),
        (
            "optim.scheduler.decay=step",
            "optim.scheduler.decay='step' is invalid: allowed: cosine, linear, constant",
        ),
        ("optim.scheduler.warmup_steps=-1", "optim.scheduler.warmup_steps=-1 is invalid"),
        ("optim.scheduler.min_lr_ratio=1.5", "optim.scheduler.min_lr_ratio=1.5 is invalid"),
        ("~optim.scheduler.decay", "optim.scheduler.decay is required"),
    ],
)
def test_validate_checks_the_optimizer_and_schedule_keys(override, message):
    with pytest.raises(UserError) as err:
        validate(make_cfg(override))
    assert str(err.value).startswith(message)


def test_validate_accepts_the_optimizer_keys_tests_and_models_use():
    validate(make_cfg("optim.optimizer.lr=1e5", "optim.optimizer.weight_decay=0"))
    validate(make_cfg("optim.optimizer.lr=1", "optim.scheduler.warmup_steps=0"))
    validate(make_cfg("model=gan"))  # its own betas


def test_a_bad_optimizer_key_in_a_sweep_fails_before_the_first_job():
    with pytest.raises(UserError, match="optim.optimizer.lr='abc' is invalid"):
        preflight(["-m", "optim.optimizer.lr=1e-3,abc", "model=mlp"])


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "model.hidden_size=abc",
            "cannot build model (tasks.classification.MLPClassifier) from the config: empty()",
        ),
        (
            "dataset.num_features=abc",
            "cannot build dataset (tasks.classification.Blobs) from the config: 'str' object",
        ),
        # Hydra's "Error loading 'tasks.nope.Task':" is unwrapped to the ImportError under it.
        (
            "model._target_=tasks.nope.Task",
            "cannot build model (tasks.nope.Task) from the config: No module named 'tasks.nope'",
        ),
        ("model.activation=relu", "model.activation='relu' is invalid"),  # the task's own line
    ],
)
def test_a_value_the_constructor_rejects_is_one_line_naming_the_group(override, message):
    with pytest.raises(UserError) as err:
        build(make_cfg(*TINY_MLP, "dataset.num_samples=64", override))
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_an_optimizer_the_config_cannot_build_is_one_line_naming_its_target():
    cfg = make_cfg(*TINY_MLP, "dataset.num_samples=64", "optim.optimizer._target_=torch.optim.SGD")
    _, task = build(cfg)
    with pytest.raises(UserError) as err:
        build_optimizers(cfg.optim, task.parameter_groups(), max_steps=2)
    assert str(err.value) == (
        "cannot build optim.optimizer (torch.optim.SGD) from the config: "
        "SGD.__init__() got an unexpected keyword argument 'betas'"
    )


def test_first_line_falls_back_to_the_type_name():
    assert first_line(ValueError("bad value\nmore detail")) == "bad value"
    assert first_line(KeyError()) == "KeyError"
