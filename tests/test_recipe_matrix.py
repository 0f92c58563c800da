"""Issue 46's matrix of recipe rules, generated, not hand-picked: every converting mode (fp8 under
each of precision.fp8.recipe's values, mxfp8, nvfp4, mxfp4) × every direction pattern a rule can
write (each of forward, input_grad and weight_grad in the mode's format, bf16 or fp32: 27), the
full product (so every pair of values too). A rule on one Linear of a tiny net (width 32, one
step): each cell either runs with the plan held and the precision manifest, what the dispatcher
saw, equal to the rule in every direction, or is one refusal line naming the rule before any
step; none is a traceback. Which cells are refused is written here from the modes' machinery
(docs/precision-modes.md's Recipes table), not read from the runner."""

from __future__ import annotations

import itertools

import pytest

from runner.errors import UserError
from runner.run import run
from tests.helpers import make_cfg, module_run
from tests.test_manifest import ops

MODULE = "net.blocks.1.0"  # Net(width=32)'s one Linear 32 wide both ways: every format takes it
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
ISLAND = ("fp32",) * 3
CELLS = [
    (mode, fp8_recipe, pattern)
    for mode in ("fp8", "mxfp8", "nvfp4", "mxfp4")
    for fp8_recipe in (FP8_RECIPES if mode == "fp8" else ("tensorwise",))
    for pattern in itertools.product((mode, "bf16", "fp32"), repeat=3)
]


def refused(mode: str, fp8_recipe: str, pattern: tuple[str, str, str]) -> bool:
    """Whether the mode's machinery cannot compute the rule: all fp32 is an fp32 island in any
    mode; the FP4 emulation computes each direction apart in any of the three; torchao's
    float8 each GEMM in fp8 or bf16 (rowwise_with_gw_hp's weight gradient bf16 only); its
    MXFP8Linear forward and input_grad in mxfp8 together, weight_grad alone high or not."""
    if pattern == ISLAND or mode in ("nvfp4", "mxfp4"):
        return False
    if "fp32" in pattern:
        return True
    if mode == "fp8":
        return fp8_recipe == "rowwise_with_gw_hp" and pattern[2] == "fp8"
    return pattern not in {(mode,) * 3, (mode, mode, "bf16"), ("bf16",) * 3}


@pytest.mark.parametrize(
    ("mode", "fp8_recipe", "pattern"),
    CELLS,
    ids=[f"{m}-{r}-{'.'.join(p)}" for m, r, p in CELLS],
)
def test_each_rule_runs_as_written_or_is_one_line(tmp_path, mode, fp8_recipe, pattern):
    rule = dict(zip(("forward", "input_grad", "weight_grad"), pattern, strict=True))
    file = tmp_path / "recipe.yaml"
    file.write_text(f"- {{module: {MODULE}, {', '.join(f'{d}: {f}' for d, f in rule.items())}}}\n")
    cfg = make_cfg(
        *module_run(
            "tests.test_own_model.Net",
            "+model.net.width=32",
            f"precision={mode}",
            f"precision.fp8.recipe={fp8_recipe}",
            f"precision.recipe={file}",
            "precision.cpu_kernels=native",  # bf16 computes in bf16, told apart from fp32
            "trainer.max_steps=1",
        )
    )
    if refused(mode, fp8_recipe, pattern):
        with pytest.raises(UserError) as error:
            run(cfg, tmp_path / "run")
        line = str(error.value)
        assert (
            "\n" not in line
            and line.startswith(f"precision.recipe {file}'s rule 1")
            or (line.startswith(f"precision.recipe rule 1 of {file}: "))
        ), line
        assert " is invalid" in line and "allowed: " in line, line
        assert not (tmp_path / "run" / "metrics.jsonl").exists()  # before any step
        return
    summary = run(cfg, tmp_path / "run")
    manifest = summary["precision_manifest"]
    assert summary["plan_held"] is True, manifest["mismatches"]
    ran = {o["direction"]: o for o in ops(summary) if o["module"] == MODULE}
    planned = dict(rule)
    if mode == "mxfp8" and pattern[:2] == (mode, mode) and pattern[2] == "bf16":
        # torchao's wgrad_with_hp multiplies the operands MXFP8Linear was given: the input
        # widened to fp32 (bf16's values under autocast), the gradient too; above the plan
        planned["weight_grad"] = "fp32"
        assert (
            f"{MODULE}'s weight grad (mm) ran in fp32, above the plan's bf16"
            in (summary["precision_manifest"]["notes"])
        )
    assert {d: o["format"] for d, o in ran.items()} == planned
    if pattern == ISLAND:  # an fp32 island: fp32 inputs too
        assert all(o["inputs"] == ["fp32"] for o in ran.values())
    converted = summary["converted"]
    if pattern in (ISLAND, ("bf16",) * 3):
        assert MODULE not in converted["converted"] and MODULE in converted["skipped"]
    else:
        assert MODULE in converted["converted"]
        assert converted["directions"][MODULE] == rule
