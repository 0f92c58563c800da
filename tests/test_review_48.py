"""Review of issue 48 (precision.autopilot): cases that broke it, each red before its fix."""

from __future__ import annotations

import pytest
import torch

from runner.config.autopilot import AutopilotConfig
from runner.errors import UserError
from runner.precision.autopilot import check
from tests.helpers import read_metrics
from tests.test_autopilot import net_run, switched

pytest.importorskip("torchao")

CONSTANT = ["optim.scheduler.decay=constant", "trainer.val_check_interval=0"]


@pytest.mark.slow
def test_an_mxfp8_switch_takes_effect_in_compiled_steps(tmp_path):
    """MXFP8's forward and input gradient move together, so the switched Linear runs plain:
    compiled steps must run it plain too (its emulation is compile-disabled, a graph break after
    which a `__dict__` read of the flag was not guarded). Eager and compiled runs agree to a few
    parts in a thousand before the switch; the format alone ends ~80% above the piloted run."""
    runs = {}
    for compiled in ("false", "true"):
        s = net_run(
            tmp_path,
            compiled,
            "ActivationOutlier",
            "mxfp8",
            60,
            *CONSTANT,
            "precision.autopilot.enabled=true",
            f"trainer.compile={compiled}",
        )
        assert switched(s) == {(41, "net.body.1", "forward+input_grad")}
        runs[compiled] = [r["loss"] for r in read_metrics(tmp_path / compiled)]
    eager, compiled = runs["false"], runs["true"]
    assert compiled[-1] == pytest.approx(eager[-1], rel=0.05), (compiled[-5:], eager[-5:])


@pytest.mark.parametrize(
    "key, value, said",
    [
        ("sqnr_drop_db", -5.0, "sqnr_drop_db=-5.0 is invalid"),  # every unit would move
        ("sqnr_drop_db", float("nan"), "sqnr_drop_db=nan is invalid"),  # none would
        ("sqnr_floor_db", {"fp8": float("nan")}, "sqnr_floor_db.fp8=nan is invalid"),
    ],
)
def test_a_margin_or_floor_that_judges_nothing_is_refused(key, value, said):
    cfg = AutopilotConfig(enabled=True, **{key: value})
    with pytest.raises(UserError, match=said):
        check(cfg, "fp8", True)


@pytest.mark.slow
def test_a_run_stopped_at_the_step_that_decides_a_switch_resumes_bit_for_bit(tmp_path):
    """The outlier emerges at step 40, measured (every 10) at step 40, the switch from 41: a
    first part that ends at step 40 must measure it, or its resume switches 10 steps late."""
    from tests.helpers import load_last

    pilot = [*CONSTANT, "precision.autopilot.enabled=true"]
    whole = net_run(tmp_path, "whole", "ActivationOutlier", "fp8", 50, *pilot)
    net_run(tmp_path, "parts", "ActivationOutlier", "fp8", 40, *pilot)
    parts = net_run(
        tmp_path, "parts", "ActivationOutlier", "fp8", 50, *pilot, "trainer.resume=auto"
    )
    assert (
        switched(parts)
        == switched(whole)
        == {
            (41, "net.body.1", "forward"),
            (41, "net.body.1", "weight_grad"),
        }
    )
    losses = [r["loss"] for r in read_metrics(tmp_path / "parts")]
    assert losses == [r["loss"] for r in read_metrics(tmp_path / "whole")]
    a, b = load_last(tmp_path / "whole")["model"], load_last(tmp_path / "parts")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
