"""precision.recipe (runner/precision/recipe.py): ordered rules, a glob on module or class
names → a format per direction, first match wins; the shorthands become rules of the same kind;
the manifest holds each converted Linear's directions to its rule; bad input is one line, exit 2,
before training."""

import functools
from types import SimpleNamespace

import pytest

from runner.errors import UserError
from runner.precision import recipe
from runner.run import run
from tests.helpers import TINY_MLP, cli, make_cfg, read_metrics
from tests.test_fp4 import _gpt
from tests.test_manifest import ops

gpt = functools.partial(_gpt, layers=2, steps=3)


def _formats(summary: dict) -> dict[tuple[str, str], str]:
    """The manifest's module × direction → the format it computed in (the audited step)."""
    return {(o["module"], o["direction"]): o["format"] for o in ops(summary)}


def _write(tmp_path, text: str, name: str = "recipe.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("mode", "module", "direction"),
    [
        ("nvfp4", "net.blocks.0.proj", "weight_grad"),
        ("fp8", "net.blocks.1.mlp.0", "forward"),  # torchao's disabled casts, emulated on a CPU
        ("fp8", "net.blocks.0.proj", "input_grad"),
    ],
)
def test_a_rule_changes_exactly_its_direction_and_the_loss(tmp_path, mode, module, direction):
    file = _write(tmp_path, f'rules:\n  - {{module: "{module}", {direction}: bf16}}\n')
    plain = run(make_cfg(*gpt(f"precision={mode}")), tmp_path / "plain")
    ruled = run(make_cfg(*gpt(f"precision={mode}", f"precision.recipe={file}")), tmp_path / "r")
    before, after = _formats(plain), _formats(ruled)
    changed = {k for k in before if before[k] != after.get(k)}
    assert changed == {(module, direction)}
    assert before[(module, direction)] == mode
    assert after[(module, direction)] in ("bf16", "fp32")  # fp32: cpu_kernels=fast's bf16
    assert ruled["plan_held"] is True
    assert ruled["converted"]["directions"][module][direction] == "bf16"
    assert any(r.startswith(f"{{module: '{module}'") for r in ruled["converted"]["recipe_in_force"])
    assert read_metrics(tmp_path / "r")[-1]["loss"] != read_metrics(tmp_path / "plain")[-1]["loss"]


def test_the_manifest_fails_a_direction_that_ran_against_its_rule(tmp_path, monkeypatch):
    """A rule keeps a weight gradient in bf16; the layer ignoring it (every GEMM in FP4) breaks
    the plan, naming the rule."""
    from runner.precision import fp4

    file = _write(tmp_path, 'rules:\n  - {module: "net.blocks.0.proj", weight_grad: bf16}\n')
    monkeypatch.setattr(fp4.Fp4Linear, "formats", fp4.LOW)
    real = fp4.Fp4Linears._convert

    def ignoring(self, model, chosen):
        real(self, model, chosen)
        for name in chosen:
            model.get_submodule(name).formats = fp4.LOW

    monkeypatch.setattr(fp4.Fp4Linears, "_convert", ignoring)
    broken = run(make_cfg(*gpt("precision=nvfp4", f"precision.recipe={file}")), tmp_path / "b")
    assert broken["plan_held"] is False
    assert any(
        m.startswith(f"rule 1 of {file} keeps net.blocks.0.proj's weight_grad in bf16;")
        for m in broken["precision_manifest"]["mismatches"]
    )


def test_shorthands_give_the_manifest_of_their_recipe(tmp_path):
    """precision.fp8.skip with a pattern, and the same as a recipe rule: one manifest."""
    short = run(
        make_cfg(*gpt("precision=fp8", "precision.fp8.skip=[first,last,net.blocks.1.proj]")),
        tmp_path / "short",
    )
    file = _write(
        tmp_path,
        "- {module: net.blocks.1.proj, forward: bf16, input_grad: bf16, weight_grad: bf16}\n",
    )
    ruled = run(make_cfg(*gpt("precision=fp8", f"precision.recipe={file}")), tmp_path / "ruled")
    assert _formats(short) == _formats(ruled)
    assert _formats(short)[("net.blocks.1.proj", "forward")] != "fp8"
    assert set(short["converted"]["converted"]) == set(ruled["converted"]["converted"])
    assert "{module: 'net.blocks.1.proj'" in short["converted"]["recipe_in_force"][-2]


@pytest.mark.slow  # the real command line, 6 processes of about 3.5 s
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- {module: '*', forward: fp9}\n", "forward='fp9' is invalid: allowed: nvfp4, bf16, fp32"),
        ("- {module: '*', backward: bf16}\n", "'backward' is not a direction (allowed: forward"),
        ("- {module: 'net.nothing.*', forward: bf16}\n", "'net.nothing.*' matches no module"),
        ("- {class: 'Conv9d', forward: bf16}\n", "'Conv9d' matches no module's class"),
        ("rules: [ {module: \n", "not YAML"),
        (None, "no such file"),
    ],
)
def test_bad_recipes_are_one_line_exit_2(tmp_path, text, message):
    file = _write(tmp_path, text) if text is not None else str(tmp_path / "missing.yaml")
    result = cli(*TINY_MLP, "precision=nvfp4", f"precision.recipe={file}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    # one line, the last (a glob is checked against the model once it is built: after the
    # opening lines, before the first step)
    assert message in lines[-1] and "precision.recipe" in lines[-1]
    assert sum("precision.recipe" in line for line in lines) == 1
    assert not any('"loss"' in m.read_text() for m in tmp_path.rglob("metrics.jsonl"))  # no step


def test_recipe_rules_the_mode_cannot_take(tmp_path):
    """mxfp8 switches weight_grad alone; rowwise_with_gw_hp's weight gradient is bf16; a GPU
    without bf16 units refuses a rule's bf16; a recipe in a mode that converts nothing."""
    mixed = _write(tmp_path, "- {module: '*', forward: bf16}\n")
    with pytest.raises(UserError, match="under mxfp8: torchao's MXFP8Linear"):
        recipe.load(mixed, "mxfp8")
    wg = _write(tmp_path, "- {module: '*', weight_grad: fp8}\n", "wg.yaml")
    with pytest.raises(UserError, match="weight_grad='fp8' is invalid: allowed: bf16"):
        recipe.load(wg, "fp8", "rowwise_with_gw_hp")
    assert recipe.load(wg, "fp8")[0].formats == ("fp8", "fp8", "fp8")
    old_gpu = SimpleNamespace(
        type="cuda", support=lambda f: (f == "fp32", "compute capability 7.0; bf16 needs ≥ 8.0")
    )
    with pytest.raises(UserError, match=r"rule 1 of .*: forward=bf16 cannot run natively here"):
        recipe.runnable(recipe.load(mixed, "nvfp4"), old_gpu, allow_emulated=False)
    recipe.runnable(recipe.load(mixed, "nvfp4"), old_gpu, allow_emulated=True)
    with pytest.raises(UserError, match="precision.recipe=.* a converting mode"):
        run(make_cfg(*TINY_MLP, "precision=bf16", f"precision.recipe={mixed}"), tmp_path / "x")


def test_mxfp8_switches_one_weight_grad_by_wgrad_with_hp(tmp_path):
    """Width 32 (mxfp8's block; the tests above are 16 wide, too narrow for it): a rule keeping
    one Linear's weight_grad in bf16 under mxfp8 sets torchao's wgrad_with_hp on that Linear
    alone, the manifest shows exactly that direction high, and the loss moves (8 steps: after 3
    the two losses were still equal to the last digit)."""
    module = "net.blocks.1.proj"
    file = _write(tmp_path, f"- {{module: {module}, weight_grad: bf16}}\n")
    wide = functools.partial(_gpt, width=32, layers=2, steps=8)
    plain = run(make_cfg(*wide("precision=mxfp8")), tmp_path / "plain")
    ruled = run(make_cfg(*wide("precision=mxfp8", f"precision.recipe={file}")), tmp_path / "r")
    before, after = _formats(plain), _formats(ruled)
    assert module in plain["converted"]["converted"] and module in ruled["converted"]["converted"]
    assert {k for k in before if before[k] != after.get(k)} == {(module, "weight_grad")}
    assert before[(module, "weight_grad")] == "mxfp8"
    assert after[(module, "weight_grad")] in ("bf16", "fp32")  # fp32: cpu_kernels=fast's bf16
    assert after[(module, "forward")] == after[(module, "input_grad")] == "mxfp8"
    assert ruled["plan_held"] is True
    assert ruled["converted"]["directions"][module] == {
        "forward": "mxfp8",
        "input_grad": "mxfp8",
        "weight_grad": "bf16",
    }
    assert read_metrics(tmp_path / "r")[-1]["loss"] != read_metrics(tmp_path / "plain")[-1]["loss"]
