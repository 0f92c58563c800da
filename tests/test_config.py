"""Bad input fails before anything runs, with one line that names the key and what is allowed."""

from __future__ import annotations

import pytest

from runner.cli import expand, preflight
from runner.config import validate
from runner.errors import UserError
from tests.helpers import make_cfg


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["precision=fp8"],
            "unknown precision 'fp8': choose from auto, bf16, fp16, fp16_master, fp32, staged, tf32",
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
        (["trainer.max_steps=abc"], "could not be converted to Integer"),
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
