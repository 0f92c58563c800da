"""The recipe search knows its noise (runner/answers/recipe_rank.py, recipe_search.py): units
ranked on several steps' measurements, ties where they cannot be ordered, and a third outcome,
within noise, where the runs cannot tell a gap from the tolerance."""

from __future__ import annotations

import math

import pytest

from runner.answers.recipe_rank import ladder, rank
from runner.answers.recipe_search import outcome
from runner.answers.recipe_verdict import verdict
from tests.helpers import error_record


def _record(module, direction, sqnr, step, fmt="nvfp4"):
    return error_record(module, direction, sqnr, step=step, fmt=fmt)


def test_units_rank_on_their_mean_over_the_steps_and_close_ones_are_tied():
    """a's forward is worst at step 1 alone (an initialization's figure); over the steps b's is.
    b and c differ by less than their spread: tied; d stands apart; e has no signal."""
    series = {
        ("a", "forward"): [10.0, 20.0, 21.0, 21.0],
        ("b", "forward"): [14.0, 15.0, 16.0, 15.0],
        ("c", "input_grad"): [15.0, 15.5, 16.5, 15.5],
        ("d", "weight_grad"): [30.0, 30.1, 30.0, 30.1],
        ("e", "forward"): [None, None, None, None],
    }
    records = [
        _record(m, d, v, step)
        for (m, d), values in series.items()
        for step, v in zip((1, 4, 8, 12), values, strict=True)
    ]
    ranked = rank(records, "nvfp4")
    assert [u["module"] for u in ranked] == ["b", "c", "a", "d", "e"]
    b, c, a, d, e = ranked
    assert b["sqnr_db"] == pytest.approx(15.0) and b["steps"] == [1, 4, 8, 12]
    assert b["sqnr_spread_db"] == pytest.approx(math.sqrt(0.5))
    assert a["sqnr_range_db"] == [10.0, 21.0]
    # b and c: 0.625 dB apart, spreads 0.71 and 0.54; a (18 dB ± 4.6) is 2.4 dB from c: tied
    assert b["tie"] == c["tie"] == a["tie"] == 1
    assert d["tie"] is None and e["tie"] is None and e["sqnr_db"] == math.inf


def test_mxfp8_units_are_what_mxfp8linear_switches_and_the_ladder_skips_what_is_kept():
    """Under mxfp8 forward and input_grad are one unit, at each step its worse; keeping it keeps
    the module whole, so the same module's weight_grad ranked after it adds nothing."""
    records = [
        _record("m", "forward", 20.0, 1, "mxfp8"),
        _record("m", "input_grad", 12.0, 1, "mxfp8"),
        _record("m", "weight_grad", 25.0, 1, "mxfp8"),
        _record("n", "weight_grad", 22.0, 1, "mxfp8"),
    ]
    ranked = rank(records, "mxfp8")
    assert [(u["module"], u["direction"], u["sqnr_db"]) for u in ranked] == [
        ("m", "forward+input_grad", 12.0),
        ("n", "weight_grad", 22.0),
        ("m", "weight_grad", 25.0),
    ]
    assert [(u["module"], u["direction"]) for u in ladder(ranked)] == [
        ("m", "forward+input_grad"),
        ("n", "weight_grad"),
    ]


@pytest.mark.parametrize(
    "gaps, noise, expected",
    [
        ([0.01], None, "passes"),  # one seed: the tolerance alone
        ([0.03], None, "fails"),
        ([0.01, 0.015], 0.01, "passes"),  # within on every seed
        ([0.01, 0.025], 0.01, "within noise"),  # the seeds disagree
        ([0.03, 0.035], 0.01, "fails"),  # beyond on every seed
        ([0.025], 0.01, "within noise"),  # beyond by less than the noise: another seed may pass
        ([0.035], 0.01, "fails"),  # beyond by more
        ([math.nan], 0.01, "fails"),  # stopped short
    ],
)
def test_a_gap_passes_fails_or_is_within_noise(gaps, noise, expected):
    assert outcome(gaps, 0.02, noise) == expected


def _result(*outcomes: str, spread: float | None = 0.012) -> dict:
    candidates = [
        {
            "k": k,
            "kept_bf16": [f"u{i}" for i in range(k)],
            "outcome": o,
            "loss_gaps": {0: 0.01},
            "converted_flop_share": 0.5,
        }
        for k, o in enumerate(outcomes)
    ]
    return {
        "precision": "nvfp4",
        "tolerance": 0.02,
        "candidates": candidates,
        "noise": {"seeds": [0, 1], "spread": spread},
        "recipe_max": 6,
        "ranked": [{}] * 6,
        "recipe": "out/recipe.yaml",
    }


def test_the_verdict_says_when_the_runs_cannot_tell():
    unsure = _result("fails", "within noise", "within noise")
    assert verdict(unsure, None).startswith(
        "cannot tell: nvfp4 candidate(s) 1, 2 end within the noise of the 2% tolerance "
        "(candidate 0's gap spread 1.20% over seeds 0, 1) and none passes on every seed"
    )
    none = _result("fails", "fails")
    assert verdict(none, None).startswith("no small set: nvfp4 stays more than 2% from bf16's")
    found = _result("fails", "within noise", "passes")
    line = verdict(found, found["candidates"][-1])
    assert line.startswith("nvfp4 trains within 2% of bf16 keeping u0, u1 in bf16")
    assert line.endswith(
        "(candidate(s) 1 within noise of the tolerance: a smaller set may do as well)"
    )
    one = _result("passes", spread=None)
    one["noise"]["seeds"] = [0]
    assert "the noise is not measured: one seed, runner.recipe_seeds=1" in verdict(
        one, one["candidates"][0]
    )
