"""precision.recipe (runner/precision/recipe.py): ordered rules, a glob on module or class
names → a format per direction, first match wins; the shorthands become rules of the same kind;
the manifest holds each converted Linear's directions to its rule; bad input is one line, exit 2,
before training."""

import functools
from pathlib import Path
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
        ("- {module: 'net.nothing.*', forward: bf16}\n", "'net.nothing.*' matches no Linear's"),
        ("- {class: 'Conv9d', forward: bf16}\n", "'Conv9d' matches no Linear's class"),
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
    with pytest.raises(UserError, match="is invalid under mxfp8: torchao's MXFP8Linear"):
        recipe.load(mixed, "mxfp8")
    wg = _write(tmp_path, "- {module: '*', weight_grad: fp8}\n", "wg.yaml")
    with pytest.raises(UserError, match="weight_grad='fp8' is invalid: allowed: bf16"):
        recipe.load(wg, "fp8", "rowwise_with_gw_hp")
    assert recipe.load(wg, "fp8")[0][0].formats == ("fp8", "fp8", "fp8")
    old_gpu = SimpleNamespace(
        type="cuda", support=lambda f: (f == "fp32", "compute capability 7.0; bf16 needs ≥ 8.0")
    )
    with pytest.raises(UserError, match=r"rule 1 of .*: forward=bf16 cannot run natively here"):
        recipe.runnable(recipe.load(mixed, "nvfp4")[0], old_gpu, allow_emulated=False)
    recipe.runnable(recipe.load(mixed, "nvfp4")[0], old_gpu, allow_emulated=True)
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
    # fp32: torchao's wgrad_with_hp multiplies the input it is given, widened to fp32 (bf16's
    # values under autocast; MXFP8._compute)
    assert after[(module, "weight_grad")] == "fp32"
    assert after[(module, "forward")] == after[(module, "input_grad")] == "mxfp8"
    assert ruled["plan_held"] is True
    assert ruled["converted"]["directions"][module] == {
        "forward": "mxfp8",
        "input_grad": "mxfp8",
        "weight_grad": "bf16",
    }
    assert read_metrics(tmp_path / "r")[-1]["loss"] != read_metrics(tmp_path / "plain")[-1]["loss"]


# --- issue 46: every rule runs as written, or is one line ------------------------------------

NATIVE = "precision.cpu_kernels=native"  # bf16 computes in bf16, told apart from fp32


def test_a_default_restating_the_mode_decides_only_what_the_shorthands_leave(tmp_path):
    """`default:` comes after the shorthands: restating nvfp4's own formats converts the same
    3 of a 2-block TinyGPT's 9 Linears (keep_bf16.last's block 1 and skip=first/last still
    win), not the 8 a default placed before them converts; it fills the directions a rule leaves
    out, and decides the Linears no rule or shorthand does."""
    plain = run(make_cfg(*gpt("precision=nvfp4")), tmp_path / "plain")
    same = _write(tmp_path, "default: {forward: nvfp4, input_grad: nvfp4, weight_grad: nvfp4}\n")
    restated = run(make_cfg(*gpt("precision=nvfp4", f"precision.recipe={same}")), tmp_path / "d")
    assert len(plain["converted"]["converted"]) == 3
    assert restated["converted"]["converted"] == plain["converted"]["converted"]
    assert _formats(restated) == _formats(plain)
    last = restated["converted"]["recipe_in_force"][-1]
    assert last.startswith("{module: '*'") and f"(the default rule of {same})" in last
    text = "rules:\n  - {module: net.blocks.0.proj, forward: bf16}\ndefault: {weight_grad: bf16}\n"
    filled = _write(tmp_path, text, "filled.yaml")
    ruled = run(make_cfg(*gpt("precision=nvfp4", f"precision.recipe={filled}")), tmp_path / "f")
    directions = ruled["converted"]["directions"]
    assert directions["net.blocks.0.proj"] == dict(
        forward="bf16", input_grad="nvfp4", weight_grad="bf16"
    )
    assert directions["net.blocks.0.mlp.0"] == dict(
        forward="nvfp4", input_grad="nvfp4", weight_grad="bf16"
    )
    assert set(directions) == set(plain["converted"]["converted"]) and ruled["plan_held"]


def test_mxfp8_refuses_forward_and_input_grad_bf16_beside_an_mxfp8_weight_grad(tmp_path):
    """torchao's MXFP8Linear computes forward and input_grad in mxfp8 whenever it converts a
    Linear: a rule keeping both bf16 with weight_grad mxfp8 (the search's old forward+input_grad
    unit) ran all three in mxfp8; it is one line naming the rule, before any step."""
    file = _write(tmp_path, "- {module: net.blocks.1.proj, forward: bf16, input_grad: bf16}\n")
    wide = functools.partial(_gpt, width=32, layers=2, steps=2)
    with pytest.raises(UserError) as refused:
        run(make_cfg(*wide("precision=mxfp8", f"precision.recipe={file}")), tmp_path / "r")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"precision.recipe rule 1 of {file}: forward=bf16, input_grad=bf16")
    assert "weight_grad=mxfp8 is invalid under mxfp8" in message
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
    default = _write(tmp_path, "default: {forward: bf16, input_grad: bf16}\n", "d.yaml")
    with pytest.raises(UserError, match=f"the default rule of {default}: forward=bf16"):
        recipe.load(default, "mxfp8")


@pytest.mark.parametrize("fp8_recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_fp8_rowwise_runs_a_bf16_direction(tmp_path, fp8_recipe):
    """A disabled cast is tensorwise: torchao refused an axiswise one ("only dynamic scaling
    type is supported for axiswise scaling granularity"). The rule's direction runs bf16, the
    recipe's others in fp8 (rowwise_with_gw_hp's weight_grad in bf16), as the manifest saw."""
    module = "net.blocks.0.proj"
    file = _write(tmp_path, f"- {{module: {module}, forward: bf16}}\n")
    overrides = ("precision=fp8", f"precision.fp8.recipe={fp8_recipe}", NATIVE)
    ruled = run(make_cfg(*gpt(*overrides, f"precision.recipe={file}")), tmp_path / "r")
    weight_grad = "bf16" if fp8_recipe == "rowwise_with_gw_hp" else "fp8"
    formats = _formats(ruled)
    assert formats[(module, "forward")] == "bf16"
    assert formats[(module, "input_grad")] == "fp8"
    assert formats[(module, "weight_grad")] == weight_grad
    assert formats[("net.blocks.0.mlp.0", "forward")] == "fp8"  # the recipe's rowwise cast
    assert ruled["plan_held"] is True


@pytest.mark.parametrize("mode", ["nvfp4", "fp8"])
def test_an_all_fp32_rule_is_an_fp32_island(tmp_path, mode, monkeypatch):
    """A rule keeping all three directions fp32 ran in bf16 (the Linear left to autocast) while
    the plan held; it is an fp32 island now in every mode: its matmuls compute in fp32 on fp32
    inputs. Left unmade, the manifest says so against the rule."""
    from runner.precision import fp32_islands

    module = "net.blocks.0.proj"
    text = f"- {{module: {module}, forward: fp32, input_grad: fp32, weight_grad: fp32}}\n"
    file = _write(tmp_path, text)
    cfg = make_cfg(*gpt(f"precision={mode}", NATIVE, f"precision.recipe={file}"))
    ruled = run(cfg, tmp_path / "r")
    rows = [o for o in ops(ruled) if o["module"] == module]
    assert {o["direction"] for o in rows} == {"forward", "input_grad", "weight_grad"}
    assert all(o["format"] == "fp32" and o["inputs"] == ["fp32"] for o in rows)
    assert ruled["converted"]["skipped"][module] == f"fp32 by rule 1 of {file}"
    assert ruled["plan_held"] is True
    assert _formats(ruled)[("net.blocks.0.mlp.0", "forward")] == mode  # the rest as before
    monkeypatch.setattr(fp32_islands, "make", lambda modules, device_type: None)
    unmade = run(cfg, tmp_path / "unmade")
    assert unmade["plan_held"] is False
    assert any(
        m.startswith(f"rule 1 of {file} keeps {module} in fp32 (an fp32 island); {module}'s")
        and m.endswith("ran in bf16")
        for m in unmade["precision_manifest"]["mismatches"]
    )


@pytest.mark.parametrize(
    ("rule", "refused"),
    [
        ("{class: LayerNorm, forward: bf16}", "class: 'LayerNorm' matches no Linear's class"),
        ("{module: net.norm, forward: bf16}", "it matches 'net.norm', which holds none"),
        ("{module: 'net.blocks.*.norm?', forward: bf16}", "matches no Linear's name"),
        ("{class: Block, weight_grad: bf16}", None),  # a module Linears sit in
        ("{module: net.blocks.1, weight_grad: bf16}", None),
    ],
)
def test_a_glob_must_match_a_linear_or_a_module_one_sits_in(tmp_path, rule, refused):
    """A class glob is held to a module glob's rule: matching no Linear, neither the Linear
    nor a module it sits in, is one line before any step (`class: LayerNorm` was in force and
    changed nothing)."""
    file = _write(tmp_path, f"- {rule}\n")
    cfg = make_cfg(*gpt("precision=nvfp4", "trainer.max_steps=1", f"precision.recipe={file}"))
    if refused is None:
        assert run(cfg, tmp_path / "r")["plan_held"] is True
        return
    with pytest.raises(UserError, match=f"precision.recipe rule 1 of {file}: .*{refused}"):
        run(cfg, tmp_path / "r")


def _docs_section() -> str:
    text = (Path(__file__).resolve().parent.parent / "docs" / "precision-modes.md").read_text()
    section = text[text.index("\n## Recipes\n") :]
    return section[: section.index("\n## ", 1)]


def docs_recipe_files() -> list[str]:
    """Every recipe file the docs show: each YAML block of README.md and docs/*.md whose first
    line is `rules:`, wherever it is (what tests/docs/table.py's YAML_BLOCKS says this runs)."""
    from tests.docs import blocks as docs

    return [
        b.code
        for b in docs.blocks()
        if b.syntax in ("yaml", "yml") and b.code.splitlines()[0].strip() == "rules:"
    ]


def test_every_recipe_file_in_the_docs_loads_and_runs_as_they_say(tmp_path):
    """Each recipe file of the docs (the Recipes section of docs/precision-modes.md's, on the
    model they name: a 4-block TinyGPT, nvfp4): it loads, runs with the plan held, every
    converted Linear's directions are what the manifest saw; the `default:` example prints the
    recipe in force the docs show, its island computes in fp32 and its default decides what no
    rule does."""
    section = _docs_section()
    blocks = docs_recipe_files()
    assert any("default:" in b for b in blocks)
    for i, text in enumerate(blocks):
        file = _write(tmp_path, text, f"docs-{i}.yaml")
        overrides = ("precision=nvfp4", NATIVE, f"precision.recipe={file}")
        summary = run(make_cfg(*_gpt(*overrides, layers=4, steps=1)), tmp_path / f"run-{i}")
        assert summary["plan_held"] is True, summary["precision_manifest"]["mismatches"]
        formats = _formats(summary)
        for name, directions in summary["converted"]["directions"].items():
            assert {d: formats[(name, d)] for d in directions} == directions
        if "default:" not in text:
            continue
        printed = section.split("this file runs as\n\n```\n", 1)[1].split("```", 1)[0]
        ran = [
            f"  {r}".replace(file, "example.yaml") for r in summary["converted"]["recipe_in_force"]
        ]
        assert ran == printed.splitlines()[1:]
        assert {formats[("net.blocks.0.qkv", d)] for d in recipe.DIRECTIONS} == {"fp32"}
        default = dict(forward="nvfp4", input_grad="nvfp4", weight_grad="bf16")
        assert summary["converted"]["directions"]["net.blocks.2.proj"] == default
        assert formats[("net.head", "forward")] == "bf16"
