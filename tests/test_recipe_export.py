"""The found recipe in the forms users' trainers read (runner/answers/recipe_export.py): torchao's
module_filter_fn and torchtitan's filter_fqns, each saying what a per-module form cannot."""

from __future__ import annotations

import pytest
import tomllib

from runner.answers.recipe_export import FILTER_FILE, TORCHTITAN_FILE, prefix_of, write

ALL = {"forward": "mxfp8", "input_grad": "mxfp8", "weight_grad": "mxfp8"}
# The run's converted Linears' report: net.attn.qkv and net.mlp.up in mxfp8 whole, net.mlp.down
# in mxfp8 with its weight gradient kept bf16 (wgrad_with_hp), net.head left out.
REPORT = {
    "converted": ["net.attn.qkv", "net.mlp.up", "net.mlp.down"],
    "skipped": {"net.head": "precision.fp8.skip=last", "net.attn.qkv_small": "dimensions"},
    "directions": {
        "net.attn.qkv": ALL,
        "net.mlp.up": ALL,
        "net.mlp.down": ALL | {"weight_grad": "bf16"},
    },
}


def _filter(path):
    scope: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), scope)  # noqa: S102 (the file we wrote)
    return scope["module_filter_fn"]


def test_the_filter_converts_what_the_recipe_converts_whole_and_keeps_the_rest_high(tmp_path):
    written = write(tmp_path, "mxfp8", REPORT, "found by a test", "net.")
    assert written == [tmp_path / FILTER_FILE, tmp_path / TORCHTITAN_FILE]
    module_filter_fn = _filter(tmp_path / FILTER_FILE)
    # the user's names: the task's child holding the model, `net.`, dropped
    expected = {
        "attn.qkv": True,
        "mlp.up": True,
        "mlp.down": False,  # a per-direction rule: kept entirely high
        "head": False,
        "attn.qkv_small": False,
        "norm": False,  # not a Linear the recipe names
        "net.attn.qkv": False,  # the runner's name is not the model's
    }
    assert {fqn: module_filter_fn(None, fqn) for fqn in expected} == expected
    text = (tmp_path / FILTER_FILE).read_text()
    assert "#   mlp.down: weight_grad in bf16" in text  # what it cannot say, said


def test_the_prefix_is_the_tasks_one_child():
    assert prefix_of(["net.blocks.0.weight", "net.head.weight"]) == "net."
    assert prefix_of(["generator.0.weight", "discriminator.0.weight"]) == ""


def test_torchtitans_filter_fqns_are_the_linears_not_converted(tmp_path):
    write(tmp_path, "mxfp8", REPORT, "found by a test", "net.")
    text = (tmp_path / TORCHTITAN_FILE).read_text()
    config = tomllib.loads(text)
    assert config["quantize"]["linear"]["mx"]["filter_fqns"] == [
        "mlp.down",
        "head",
        "attn.qkv_small",
    ]
    # torchtitan matches by substring: a kept name inside a converted one is said
    assert "#   'attn.qkv' is part of" not in text
    write(tmp_path, "fp8", REPORT, "found by a test", "net.")
    config = tomllib.loads((tmp_path / TORCHTITAN_FILE).read_text())
    assert config["quantize"]["linear"]["float8"]["filter_fqns"][0] == "mlp.down"


def test_a_kept_name_inside_a_converted_one_is_flagged(tmp_path):
    report = {
        "converted": ["blocks.1.fc", "blocks.1.fc2"],
        "skipped": {},
        "directions": {"blocks.1.fc": {"forward": "bf16"}, "blocks.1.fc2": {"forward": "fp8"}},
    }
    write(tmp_path, "fp8", report, "found by a test")
    text = (tmp_path / TORCHTITAN_FILE).read_text()
    assert "#   'blocks.1.fc' is part of 'blocks.1.fc2'" in text  # torchtitan would skip fc2 too
    assert 'filter_fqns = ["blocks.1.fc"]' in text
    assert _filter(tmp_path / FILTER_FILE)(None, "blocks.1.fc2") is True


@pytest.mark.parametrize("mode", ["nvfp4"])
def test_a_mode_torchtitans_float8_and_mx_converters_do_not_train_gets_the_filter_only(
    tmp_path, mode
):
    assert write(tmp_path, mode, REPORT, "found by a test") == [tmp_path / FILTER_FILE]
