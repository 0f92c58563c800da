"""Promises of docs/precision-modes.md that no other test held (issue 51): each test here went red
with the code broken as its docstring says, and green again once restored."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from runner.answers.recipe_search import FAILS, NOISE, PASSES, RecipeSearch, outcome
from runner.precision.fp4 import Recipe, _Fp4Linear
from runner.precision.fp4_quant import NVFP4
from tests.test_fp4 import _Gemms

# --- `fp4.sr`: "gradients (dy, in both backward GEMMs) stochastically rounded into E2M1" ------


def _backward_operands(sr: bool) -> tuple[dict, torch.Tensor]:
    """One FP4 Linear's backward on a dy of 2.4s (between E2M1's 2 and 3) with a 6 in every
    block either way it is cut (so each block's scale decodes to 1): each GEMM's dequantized dy."""
    dy = torch.full((64, 64), 2.4)
    dy[::16, :] = 6.0  # a 6 in each block along the tokens (dW = dyᵀ x)
    dy[:, ::16] = 6.0  # and in each along the outputs (dx = dy W)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    gemms = _Gemms()
    with gemms:  # rht off: the weight gradient's dy is dy itself, not rotated
        _Fp4Linear.apply(x, w, Recipe(NVFP4, rht=False, sr=sr, seed=0), "Linear").backward(dy)
    return {"dy,w": gemms.seen["dy,w"][0], "dy,x": gemms.seen["dy,x"][0].t()}, dy


@pytest.mark.parametrize("gemm", ["dy,w", "dy,x"], ids=["input_grad", "weight_grad"])
def test_sr_rounds_dy_stochastically_in_both_backward_gemms(gemm):
    """Broken on purpose (red, then restored): runner/precision/fp4.py's input-gradient GEMM
    quantizing dy with `stochastic=False` (round to nearest) fails the input_grad case; the
    weight gradient's the weight_grad case."""
    operands, dy = _backward_operands(sr=True)
    values = operands[gemm][dy == 2.4].round(decimals=4)
    assert set(values.unique().tolist()) == {2.0, 3.0}  # up or down, not always down
    se = (0.4 * 0.6 / values.numel()) ** 0.5
    assert abs(values.mean().item() - 2.4) < 4 * se  # unbiased: 3 four times in ten
    nearest, _ = _backward_operands(sr=False)  # the control: round to nearest is biased
    assert nearest[gemm][dy == 2.4].round(decimals=4).unique().tolist() == [2.0]


# --- the recipe search: a candidate passes "whose mean loss ... is at most compare.tolerance"
# above bf16's: one-sided, a candidate better than bf16 passes however much better ------------


@pytest.mark.parametrize(
    "gaps, noise",
    [([-0.10], None), ([-0.10], 0.01), ([-0.30, -0.25], 0.01), ([-0.05, 0.015], 0.01)],
)
def test_a_candidate_better_than_bf16_passes(gaps, noise):
    """Broken on purpose (red): `outcome` comparing abs(gap) with the tolerance (two-sided)."""
    assert outcome(gaps, 0.02, noise) == PASSES
    assert outcome([abs(g) + 0.05 for g in gaps], 0.02, noise) == FAILS  # as far above: refused


def test_the_gap_is_signed_lower_loss_below_zero():
    """A candidate's gap on a seed is (its tail loss − bf16's) / |bf16's|: a candidate 10% below
    bf16 is −10%, so it passes. Broken on purpose (red): the gap taken as its absolute value."""
    search = SimpleNamespace(trials=SimpleNamespace(steps=4), bf16={0: 2.0})
    rows = [{"loss": 1.8}] * 4
    gap = RecipeSearch.gap(search, rows, 0, {"steps": 4})
    assert gap == pytest.approx(-0.10)
    assert outcome([gap], 0.02, None) == PASSES
    assert math.isnan(RecipeSearch.gap(search, rows, 0, {"steps": 3}))  # stopped short


# --- the modes' table: `staged`'s default, nvfp4/mxfp4 "always emulated ... a GPU refuses it
# unless precision.allow_emulated=true" -------------------------------------------------------


def _precision(*overrides: str, caps=None):
    from runner.precision import Precision
    from tests.helpers import make_cfg

    return Precision(make_cfg(*overrides).precision, torch.device("cpu"), caps)


def test_staged_by_default_is_fp32_for_steps_1_to_100_then_bf16():
    """Broken on purpose (red): conf/precision/staged.yaml's until_step 101, or `at_step`
    comparing `step <= until`."""
    precision = _precision("precision=staged")
    precision.at_step(99)  # after 99 steps: the 100th runs
    assert precision.mode == "fp32"
    precision.at_step(100)  # the 101st
    assert precision.mode == "bf16"
    precision.close()


@pytest.mark.parametrize("mode", ["nvfp4", "mxfp4"])
def test_fp4_is_refused_on_a_gpu_unless_emulation_is_allowed_and_warned_on_a_cpu(mode):
    """Even on a B200 (no FP4 kernels are wired). Broken on purpose (red): DeviceCaps.support
    calling FP4 native on a GPU, or plan.py's refusal ignoring `allow_emulated`."""
    from runner.errors import UserError
    from runner.precision import DeviceCaps

    b200 = DeviceCaps("cuda", "NVIDIA B200", cuda_capability=(10, 0))
    with pytest.raises(UserError, match=rf"precision={mode} is not supported natively here"):
        _precision(f"precision={mode}", caps=b200)
    allowed = _precision(f"precision={mode}", "precision.allow_emulated=true", caps=b200)
    cpu = _precision(f"precision={mode}", caps=DeviceCaps("cpu", "AMD EPYC"))
    for precision in (allowed, cpu):
        assert precision.mode == mode
        assert any("emulated" in w for w in precision.warnings), precision.warnings
        precision.close()


# --- the precision.fp4 keys' table: defaults per format, and mxfp4 "round to nearest" -------


@pytest.mark.parametrize("mode, on", [("nvfp4", True), ("mxfp4", False)])
def test_fp4_keys_default_as_the_table_says(mode, on):
    """weight_2d, rht and sr on for nvfp4, off for mxfp4 (round to nearest: its dy rounds the
    same way every time); keep_bf16 {first: 0, last: 1}; skip [first, last]; min_features 0;
    convert_adapters false. Broken on purpose (red): Fp4Linears.configure dropping `fp4.sr`
    (the Recipe's default, on, for mxfp4) or conf/precision/mxfp4.yaml with `sr: true`."""
    precision = _precision(f"precision={mode}")
    linears = precision.converted
    linears.configure(precision.cfg.fp4)
    recipe = linears.recipe
    assert (recipe.weight_2d, recipe.rht, recipe.sr) == (on, on, on)
    assert recipe.fmt.name == mode
    assert linears.keep_bf16 == (0, 1) and linears.patterns == ["first", "last"]
    assert linears.min_features == 0 and linears.convert_adapters is False
    dy = torch.full((64, 64), 2.4)
    dy[:, ::32] = 6.0  # a 6 in every block: each block's scale decodes to 1
    dequantized = fp4_dequantized(recipe, dy)[dy == 2.4]
    assert (len(dequantized.unique()) > 1) is on  # stochastic: up or down; nearest: always 2
    precision.close()


def fp4_dequantized(recipe, t: torch.Tensor) -> torch.Tensor:
    """`t` as the recipe quantizes a gradient (stochastically where its `sr` is on), dequantized."""
    return recipe.q(t, "Linear", "grad_output", stochastic=recipe.sr).dequantize()


# --- the directions' table: "a high one multiplies the unquantized operands" -----------------


@pytest.mark.parametrize("high", ["fp32", "bf16"])
@pytest.mark.parametrize("direction", [0, 1, 2], ids=["forward", "input_grad", "weight_grad"])
def test_a_direction_kept_high_multiplies_the_unquantized_operands(direction, high):
    """That direction's GEMM equals the plain one on x, W and dy in `high` (the others run in
    FP4, so they differ). Broken on purpose (red): `_Fp4Linear.backward` reading the weight
    gradient's format for the input gradient (and the weight_grad case: the input's)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g, requires_grad=True)
    w = torch.randn(48, 64, generator=g, requires_grad=True)
    dy = torch.randn(32, 48, generator=g)
    formats = ["fp4"] * 3
    formats[direction] = high
    y = _Fp4Linear.apply(x, w, Recipe(NVFP4, seed=0), "Linear", tuple(formats))
    y.backward(dy)
    dtype = torch.float32 if high == "fp32" else torch.bfloat16
    xs, ws, dys = (t.detach().to(dtype) for t in (x, w, dy))
    plain = [xs @ ws.t(), dys @ ws, dys.t() @ xs]
    got = [y.detach(), x.grad, w.grad]
    for i in range(3):
        same = torch.allclose(got[i], plain[i].float(), rtol=1e-6, atol=1e-5)
        assert same is (i == direction), (i, (got[i] - plain[i].float()).abs().max())


# --- the recipe search's boundaries: "at most compare.tolerance" passes, exactly there too ----


def test_a_gap_exactly_at_the_tolerance_passes_and_exactly_noise_beyond_it_is_within_noise():
    """Binary-exact figures (tolerance 1/4, noise 1/8). Found by the mutation run (a survivor,
    then red): `outcome` with `gaps[0] < tolerance`, `max(gaps) < tolerance`, `min(gaps) >=
    tolerance` or `gaps[0] - tolerance >= noise`."""
    assert outcome([0.25], 0.25, None) == PASSES  # at most the tolerance: at it passes
    assert outcome([0.25, 0.0], 0.25, 0.125) == PASSES  # every seed at most
    assert outcome([0.25, 0.5], 0.25, 0.125) == NOISE  # not every seed beyond it
    assert outcome([0.375], 0.25, 0.125) == NOISE  # exactly the noise beyond: not told apart
    assert outcome([0.375], 0.25, None) == FAILS  # one seed, noise unmeasured: refused


# --- the fp4 health column ("under 1% of every tensor's blocks saturate or underflow"): the
# counts it is read from add up over every quantization ----------------------------------------


def test_fp4_health_counts_every_quantized_block_and_adds_up():
    """Found by the mutation run (a survivor, then red): `Recipe.q` subtracting a quantization's
    counts from the running ones instead of adding them."""
    x = torch.ones(64, 32)
    x[0] = 1e-12  # far under the tensor's scale: both its blocks quantize to zeros (underflow)
    recipe = Recipe(NVFP4, seed=0)
    recipe.q(x, "Linear", "input")
    once = recipe.counts[("Linear", "input")].clone()
    assert once.tolist() == [128.0, 0.0, 2.0]  # blocks, saturated, underflowed
    recipe.q(x, "Linear", "input")
    assert recipe.counts[("Linear", "input")].tolist() == (2 * once).tolist()


# --- stochastic rounding unbiased between every pair of E2M1 points (the grid's steps are 0.5,
# 1 and 2: a value between 2 and 3 alone cannot tell a wrong step from the right one) ----------


@pytest.mark.parametrize("value", [0.3, 0.75, 1.2, 1.8, 2.4, 3.5, 4.8, 5.5])
def test_stochastic_rounding_is_unbiased_between_every_pair_of_grid_points(value):
    """Found by the mutation run (survivors, then red): `e2m1_stochastic` taking the point below
    as the one above (`below - 1`) or multiplying by the step instead of dividing."""
    from runner.precision.fp4_quant import E2M1_GRID, e2m1_stochastic

    grid = torch.tensor(E2M1_GRID)
    codes = e2m1_stochastic(torch.full((8192,), value), torch.Generator().manual_seed(0))
    values = grid[codes.long()]
    low = max(p for p in E2M1_GRID if p <= value)
    high = min(p for p in E2M1_GRID if p > value)
    assert set(values.unique().tolist()) == {low, high}  # its two neighbours, both
    p = (value - low) / (high - low)
    se = (high - low) * (p * (1 - p) / values.numel()) ** 0.5
    assert abs(values.mean().item() - value) < 4 * se  # unbiased


def test_a_tensor_that_does_not_split_into_its_tiles_is_refused():
    """Found by the mutation run (a survivor, then red): `_tiles` refusing only a tensor whose
    rows and columns both fail to split."""
    from runner.precision.fp4_quant import quantize

    for shape in ((20, 16), (16, 20)):
        with pytest.raises(ValueError, match="does not split into 16×16 tiles"):
            quantize(torch.ones(shape), NVFP4, tile=(16, 16))


# --- the comparison's loss words (runner/compare/loss_gap.py's loss_class): "worse" beyond the
# tolerance, "equivalent" where the interval and every seed lie within it, exactly at it too ---

TOL = 0.25  # binary-exact, so a figure can sit exactly at ±τ


def _figures(gap, low, high, worst, best, twin=False) -> dict:
    return {
        "loss_gap": gap,
        "loss_gap_ci_low": low,
        "loss_gap_ci_high": high,
        "loss_gap_worst_seed": worst,
        "loss_gap_best_seed": best,
        "loss_gap_worst_seed_twin": twin,
    }


NAN = math.nan


@pytest.mark.parametrize(
    "figures, words",
    [
        (_figures(NAN, NAN, NAN, NAN, NAN), "no loss"),
        (_figures(0.6, 0.5, 0.75, 0.7, 0.5), "worse"),
        (_figures(0.375, 0.25, 0.5, 0.25, 0.25), "untested"),  # low exactly at +τ: not beyond
        (_figures(0.5, NAN, NAN, 0.5, 0.5), "worse in a seed"),  # one seed beyond, no twin
        (_figures(0.25, NAN, NAN, 0.25, 0.25), "one seed"),  # one seed exactly at +τ
        (_figures(0.1, 0.0, 0.2, 0.5, 0.0), "seed beyond"),
        (_figures(0.3, 0.0, 0.5, 0.5, 0.0, twin=True), "worse in a seed"),
        (_figures(0.25, 0.0, 0.5, 0.5, 0.0, twin=True), "seed beyond"),  # the row's gap at +τ
        (_figures(0.375, 0.0, 0.5, 0.5, 0.0), "seed beyond"),  # no twin: cannot be told
        (_figures(0.1, 0.0, 0.2, 0.25, 0.0), "equivalent"),  # the worst seed exactly at +τ
        (_figures(0.1, 0.0, 0.25, 0.2, 0.0), "equivalent"),  # the interval's top exactly at +τ
        (_figures(-0.1, -0.25, 0.1, 0.1, -0.25), "equivalent"),  # exactly at −τ
        (_figures(0.0, 0.0, 0.125, 0.125, -0.5), "no worse"),  # a seed far below: not "equal"
        (_figures(-0.3, -0.5, 0.0, 0.0, -0.5), "no worse"),  # the interval reaches 0
        (_figures(-0.4, -0.5, -0.375, -0.375, -0.5), "below"),
    ],
)
def test_the_loss_words_follow_the_tolerance_at_its_edges(figures, words):
    """Found by the mutation run over runner/compare/loss_gap.py (survivors, then red): each of
    `loss_class`'s comparisons with ±τ made inclusive or exclusive the other way, its `and`s as
    `or`, and the one-seed test (`not math.isfinite(low)`) negated."""
    from runner.compare.loss_gap import loss_class

    assert loss_class(figures, TOL) == words
