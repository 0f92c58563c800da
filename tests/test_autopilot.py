"""precision.autopilot (issue 48): a unit whose measured error says its format no longer holds it
moves to bf16 from the next step, and only that unit. The truth is set by the nets of
tests/autopilot_nets.py (an outlier that emerges at step 40 in one Linear); what ran is read off
the precision manifest (the dispatcher's record of the step after each switch), the losses off
the runs themselves."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.config.autopilot import AutopilotConfig
from runner.errors import UserError
from runner.precision.autopilot import Autopilot, check
from runner.run import run
from tests.helpers import load_last, make_cfg, read_metrics

pytest.importorskip("torchao")

K, EVERY = 40, 10  # the outlier's step, the autopilot's measuring interval
TOLERANCE = 0.02  # compare.tolerance's default: the gap a row may have to bf16


def net_run(tmp: Path, name: str, net: str, mode: str, steps: int, *extra: str) -> dict:
    """One run of a net of tests/autopilot_nets.py on blobs, evaluated at its last step (where
    `extra` sets no trainer.val_check_interval)."""
    evaluate = (
        []
        if any("val_check_interval" in o for o in extra)
        else [f"trainer.val_check_interval={steps}"]
    )
    cfg = make_cfg(
        "model=module",
        f"model.net._target_=tests.autopilot_nets.{net}",
        "dataset=blobs",
        f"precision={mode}",
        f"trainer.max_steps={steps}",
        "trainer.log_every_n_steps=10",
        "trainer.progress_bar=false",
        "logger=none",
        f"precision.autopilot.every_n_steps={EVERY}",
        *evaluate,
        *extra,
    )
    return run(cfg, tmp / name)


def switched(summary: dict) -> set[tuple[int, str, str]]:
    """(step, module, directions) of each switch the run made."""
    return {(s["step"], s["module"], s["directions"]) for s in summary["autopilot"]["switches"]}


def ran(summary: dict, step: int, module: str) -> dict[str, str]:
    """What `module`'s matmuls ran in at audited step `step`, by direction (the manifest)."""
    stage = next(s for s in summary["precision_manifest"]["stages"] if s["step"] == step)
    return {op["direction"]: op["format"] for op in stage["modules"][module]["ops"]}


def gap(summary: dict, reference: dict) -> float:
    return summary["eval_loss"] / reference["eval_loss"] - 1


CASES = {
    # mode, net, the low format's name in the manifest, the directions the outlier breaks
    "fp8": ("fp8", "ActivationOutlier", "fp8", {"forward", "weight_grad"}),
    "nvfp4": ("nvfp4", "GradientOutlier", "nvfp4", {"input_grad", "weight_grad"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_an_emerging_outlier_moves_its_units_and_no_others(tmp_path, case):
    """Against bf16 and against the same format on the same net with nothing emerging (`Clean`:
    what the format reaches on its own; nvfp4 ends 3.2% above bf16 on it): the format alone
    stalls after the outlier; the autopilot moves the broken directions of that one Linear at
    the first measurement after it, and the run ends where the clean one does."""
    mode, net, low, broken = CASES[case]
    steps = 120
    bf16 = net_run(tmp_path, "bf16", net, "bf16", steps)
    clean = net_run(tmp_path, "clean", "Clean", mode, steps)
    static = net_run(tmp_path, "static", net, mode, steps)
    piloted = net_run(tmp_path, "piloted", net, mode, steps, "precision.autopilot.enabled=true")
    assert gap(static, clean) > 5 * TOLERANCE  # the format alone stalls after the outlier
    assert switched(piloted) == {(K + 1, "net.body.1", d) for d in broken}
    # where the format ends without the outlier (nvfp4: 3.2% above bf16 here; fp8: bf16's
    # result): one seed's path after a switch moves its eval by up to 2.1% (fp8: 0.2019 against
    # bf16's 0.1984, clean fp8's 0.1976), so the bound is twice the tolerance; the format alone
    # ends 98-147% above
    reference = bf16 if mode == "fp8" else clean
    assert abs(gap(piloted, reference)) < 2 * TOLERANCE, (piloted["eval_loss"], reference)
    assert piloted["plan_held"] is True
    # the dispatcher: body.1's broken directions in bf16 from the switch on, the others in format
    before, after = ran(piloted, 1, "net.body.1"), ran(piloted, K + 1, "net.body.1")
    assert set(before.values()) == {low}
    # (bf16's arithmetic: fp32 where the CPU computes bf16 matmuls in fp32, cpu_kernels=fast)
    assert {d for d, f in after.items() if f != low} == broken
    assert {d for d, f in after.items() if f == low} == {
        "forward",
        "input_grad",
        "weight_grad",
    } - broken
    assert ran(piloted, K + 1, "net.body.2") == ran(piloted, 1, "net.body.2")  # untouched
    share = piloted["autopilot"]["low_flop_share"]
    assert 0 < share < static["converted"]["converted_flop_share"]
    rows = read_metrics(tmp_path / "piloted")
    assert len({r["low_flop_share"] for r in rows if r["step"] <= K}) == 1
    assert rows[K]["low_flop_share"] < rows[K - 1]["low_flop_share"]
    # the recipe it ended with, applied from step 1: those directions bf16 from the start
    recipe = piloted["autopilot"]["recipe"]
    again = net_run(tmp_path, "recipe", net, mode, 2, f"precision.recipe={recipe}")
    assert {d for d, f in ran(again, 1, "net.body.1").items() if f != low} == broken


@pytest.mark.slow
@pytest.mark.parametrize("stop", [K - 5, K + 5])  # a resume before the switch, and after it
def test_a_resume_across_a_switch_continues_bit_for_bit(tmp_path, stop):
    """A constant learning rate and no evaluation, so that the first part may stop early."""
    pilot = [
        "precision.autopilot.enabled=true",
        "optim.scheduler.decay=constant",
        "trainer.val_check_interval=0",
    ]
    whole = net_run(tmp_path, "whole", "ActivationOutlier", "fp8", 60, *pilot)
    net_run(tmp_path, "parts", "ActivationOutlier", "fp8", stop, *pilot)
    parts = net_run(
        tmp_path, "parts", "ActivationOutlier", "fp8", 60, *pilot, "trainer.resume=auto"
    )
    assert switched(parts) == switched(whole) != set()
    assert [r["loss"] for r in read_metrics(tmp_path / "parts")] == [
        r["loss"] for r in read_metrics(tmp_path / "whole")
    ]
    a, b = load_last(tmp_path / "whole"), load_last(tmp_path / "parts")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name


@pytest.mark.slow
def test_a_clean_net_moves_nothing_over_seeds(tmp_path):
    """The defaults on a net with nothing emerging, fp8 and nvfp4, 3 seeds each: no switch."""
    for mode in ("fp8", "nvfp4"):
        for seed in range(3):
            s = net_run(
                tmp_path,
                f"{mode}{seed}",
                "Clean",
                mode,
                80,
                f"seed={seed}",
                "precision.autopilot.enabled=true",
            )
            assert switched(s) == set(), (mode, seed)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fp8", "nvfp4"])
def test_a_clean_gpt_moves_nothing_over_seeds(tmp_path, mode):
    """A small GPT of the user's (its own blocks, attention and MLP) with the defaults, every
    Linear but its head in the format, measured every 10 steps over 3 seeds: no switch."""
    from tests.test_fp4 import _gpt

    for seed in range(3):
        cfg = make_cfg(
            *_gpt(f"precision={mode}", width=32, steps=60),
            "precision.fp8.skip=[last]" if mode == "fp8" else "precision.fp4.skip=[last]",
            f"seed={seed}",
            "precision.autopilot.enabled=true",
            f"precision.autopilot.every_n_steps={EVERY}",
        )
        s = run(cfg, tmp_path / f"{seed}")
        assert s["autopilot"]["measured_steps"] == 6  # the last step too
        assert switched(s) == set(), (seed, s["autopilot"]["switches"])


@pytest.mark.slow
def test_final_bf16_moves_every_unit_for_the_last_steps(tmp_path):
    s = net_run(
        tmp_path,
        "final",
        "Clean",
        "fp8",
        40,
        "precision.autopilot.enabled=true",
        "precision.autopilot.final_bf16=0.25",
    )
    assert {(step, d) for step, _, d in switched(s)} == {
        (31, d) for d in ("forward", "input_grad", "weight_grad")
    }
    assert {m for _, m, _ in switched(s)} == {"net.body.1", "net.body.2"}
    assert "fp8" not in set(ran(s, 31, "net.body.1").values())
    rows = read_metrics(tmp_path / "final")
    assert rows[30]["low_flop_share"] == 0 < rows[29]["low_flop_share"]
    pilot = s["autopilot"]
    assert pilot["final_bf16_from_step"] == 31
    losses = [r["loss"] for r in rows]
    assert pilot["final_bf16_loss"] == pytest.approx(sum(losses[30:]) / 10)
    assert pilot["loss_before_final_bf16"] == pytest.approx(sum(losses[20:30]) / 10)
    # the recipe written is the autopilot's own decisions: none here
    assert "module:" not in Path(s["autopilot"]["recipe"]).read_text()


# -- the rule itself, on records whose figures are set --------------------------------------


class _Converted:
    """What the autopilot reads and writes of the converted Linears (a plan, and `switch`)."""

    def __init__(self, compute: str, names=("a", "b")):
        self.compute, self.plan = compute, {n: (compute,) * 3 for n in names}
        self.made: list = []

    def switch(self, name, formats, step, source):
        self.plan = {**self.plan, name: formats}
        self.made.append((step, name, formats))


def _record(module, direction, sqnr, fmt="fp8", flushed=0.0) -> dict:
    operands = {"x": {"underflow": flushed}, "w": {"underflow": 0.0}}
    return {
        "module": module,
        "direction": direction,
        "sqnr_db": sqnr,
        "format": fmt,
        "operands": operands,
    }


def _pilot(compute="fp8", **cfg) -> tuple[Autopilot, _Converted]:
    converted = _Converted(compute)
    config = AutopilotConfig(enabled=True, **cfg)
    return Autopilot(config, converted, torch.device("cpu")), converted


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("offset", [-3.0, -0.01, 0.01, 3.0])
def test_the_floor_moves_a_unit_exactly_below_it(fmt, offset):
    pilot, converted = _pilot(fmt)
    floor = AutopilotConfig().sqnr_floor_db[fmt]
    records = [
        _record(m, d, 30.0, fmt)
        for m in ("a", "b")
        for d in ("forward", "input_grad", "weight_grad")
    ]
    records[1] = _record("a", "input_grad", floor + offset, fmt)
    made = pilot.measured(records, 10)
    if offset > 0:
        assert made == []
    else:
        want = ("forward", "input_grad") if fmt == "mxfp8" else ("input_grad",)
        assert [(s.step, s.module, s.directions) for s in made] == [(11, "a", want)]
        # MXFP8's forward and input gradient take its weight gradient with them
        expect = ("bf16",) * 3 if fmt == "mxfp8" else (fmt, "bf16", fmt)
        assert converted.plan["a"] == expect and converted.plan["b"] == (fmt,) * 3


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("share", [0.0, 0.05, 0.3, 0.59, 0.61, 0.99])
def test_the_flushed_ceiling_is_per_format(fmt, share):
    pilot, _ = _pilot(fmt)
    made = pilot.measured([_record("a", "forward", 30.0, fmt, flushed=share)], 10)
    assert bool(made) == (share > AutopilotConfig().flushed_ceiling[fmt])


@pytest.mark.parametrize("fall", [2.0, 7.9, 8.1, 20.0])
def test_a_fall_below_the_units_own_median_moves_it(fall):
    pilot, _ = _pilot("fp8")
    for step, sqnr in ((1, 30.0), (10, 31.0), (20, 29.0)):  # median 30
        assert pilot.measured([_record("a", "forward", sqnr)], step) == []
    made = pilot.measured([_record("a", "forward", 30.0 - fall)], 30)
    assert bool(made) == (fall > AutopilotConfig().sqnr_drop_db)


def test_a_fall_needs_two_earlier_measurements_and_ignores_exact_ones():
    pilot, _ = _pilot("fp8", sqnr_drop_db=1.0)
    assert pilot.measured([_record("a", "forward", math.inf)], 1) == []  # exact: no history
    assert pilot.measured([_record("a", "forward", 40.0)], 10) == []
    assert pilot.measured([_record("a", "forward", 30.0)], 20) == []  # one earlier: not judged
    assert pilot.measured([_record("a", "forward", 20.0)], 30) != []


def test_a_nan_sqnr_is_the_worst_and_an_unmeasured_unit_stays():
    pilot, converted = _pilot("fp8")
    made = pilot.measured([_record("a", "forward", math.nan)], 10)
    assert [(s.module, s.directions) for s in made] == [("a", ("forward",))]
    assert converted.plan["b"] == ("fp8",) * 3  # b was not measured: nothing decided


def test_a_switched_unit_is_not_judged_again():
    pilot, converted = _pilot("fp8")
    pilot.measured([_record("a", "forward", 1.0)], 10)
    assert pilot.measured([_record("a", "forward", 1.0, fmt="bf16")], 20) == []
    assert len(converted.made) == 1


@pytest.mark.parametrize("every", [1, 5, 10])
@pytest.mark.parametrize("final", [0.0, 0.1, 0.5])
def test_measured_steps_and_the_final_phase(every, final):
    pilot, converted = _pilot("fp8", every_n_steps=every, final_bf16=final)
    steps = 40
    first_final = steps - round(final * steps) + 1
    due = [s for s in range(1, steps + 1) if pilot.due(s, steps)]
    assert due == [s for s in range(every, first_final, every)]  # the last step too
    made = [s for step in range(1, steps + 1) for s in pilot.at_step(step, steps)]
    if final:
        assert {s.step for s in made} == {first_final}
        assert all(f == ("bf16",) * 3 for f in converted.plan.values())
    else:
        assert made == []


def test_its_state_makes_the_same_switches_again():
    pilot, converted = _pilot("fp8")
    pilot.measured([_record("a", "forward", 30.0)], 10)
    pilot.measured([_record("a", "weight_grad", 1.0)], 20)
    state = json.loads(json.dumps(pilot.state_dict()))  # as a checkpoint carries it
    again, converted_again = _pilot("fp8")
    again.load_state_dict(state)
    assert converted_again.plan == converted.plan and again.history == pilot.history
    assert again.switches == pilot.switches


@pytest.mark.parametrize(
    "key, value, said",
    [
        ("every_n_steps", 0, "precision.autopilot.every_n_steps=0 is invalid"),
        ("final_bf16", 1.0, "precision.autopilot.final_bf16=1.0 is invalid"),
        ("final_bf16", -0.1, "precision.autopilot.final_bf16=-0.1 is invalid"),
        ("flushed_ceiling", {"fp8": 0.0}, "precision.autopilot.flushed_ceiling.fp8=0.0 is invalid"),
    ],
)
def test_a_bad_value_is_one_line(key, value, said):
    with pytest.raises(UserError, match=said.replace(".", r"\.").replace("[", r"\[")):
        check(AutopilotConfig(enabled=True, **{key: value}), "fp8", converting=True)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16"])
def test_it_needs_a_converting_mode(mode):
    with pytest.raises(
        UserError, match=f"invalid with precision={mode}.*allowed: fp8, mxfp8, nvfp4, mxfp4"
    ):
        check(AutopilotConfig(enabled=True), mode, converting=False)


def test_the_command_line_switch_and_a_bad_mode_in_one_line(tmp_path):
    """`precision.autopilot=true` (the alias of .enabled=true) as a user types it: under bf16,
    one line, exit 2, no traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner",
            "precision=bf16",
            "precision.autopilot=true",
            "model=mlp",
            "trainer.max_steps=1",
            "logger=none",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "precision.autopilot.enabled=true is invalid with precision=bf16" in proc.stderr


def spy_switches(rank: int):
    """In a rank (tests/test_distributed.py's run_ranks): the switches its autopilot made, and
    what its body.1's GEMMs computed in at the end (its torchao config's disabled casts)."""
    made = []
    measured = Autopilot.measured

    def recording(self, records, step):
        out = measured(self, records, step)
        made.extend((s.step, s.module, "+".join(s.directions)) for s in out)
        return out

    Autopilot.measured = recording

    def figures() -> dict:
        out = {"switches": sorted(made)}
        made.clear()
        return out

    return figures


@pytest.mark.slow  # starts two ranks
def test_two_ranks_switch_the_same_units_at_the_same_step(tmp_path):
    """The outlier emerges on rank 1 alone: both ranks switch, at the same step."""
    from tests.test_distributed import run_ranks

    overrides = [
        "model=module",
        "model.net._target_=tests.autopilot_nets.ActivationOutlier",
        "+model.net.only_rank=1",
        "dataset=blobs",
        "precision=fp8",
        "trainer.max_steps=50",
        "trainer.val_check_interval=0",
        "trainer.progress_bar=false",
        "logger=none",
        "precision.autopilot.enabled=true",
        f"precision.autopilot.every_n_steps={EVERY}",
    ]
    (reports,) = run_ranks([(overrides, tmp_path / "ddp")], spy=spy_switches)
    want = [[K + 1, "net.body.1", d] for d in ("forward", "weight_grad")]
    assert [r["switches"] for r in reports] == [want, want]
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["plan_held"] is True
    assert {d for d, f in ran(summary, K + 1, "net.body.1").items() if f != "fp8"} == {
        "forward",
        "weight_grad",
    }


def test_a_sweeps_row_names_the_autopilot_by_its_switch():
    """`precision.autopilot=true,false` sweeps precision.autopilot.enabled: its rows read
    "fp8 autopilot=true", not "enabled=true"."""
    from runner.compare.jobs import _name

    assert _name("precision.autopilot.enabled") == "autopilot"
    assert _name("precision.autopilot.every_n_steps") == "every_n_steps"
    assert _name("trainer.max_steps") == "max_steps"


@pytest.mark.slow
@pytest.mark.parametrize("at", [K, K + 1, 55])  # the measured step, the switch's, the final phase's
def test_a_sigterm_at_each_phase_resumes_bit_for_bit(tmp_path, monkeypatch, at):
    """SIGTERM as step `at` begins (the step that decides the switch, the first in bf16, one in
    the final phase): the run checkpoints after that step, exits preempted, and its resume ends
    as the uninterrupted run does (losses, weights, switches)."""
    from runner.errors import Preempted
    from tests.test_signals import signal_in_step

    pilot = [
        "precision.autopilot.enabled=true",
        "precision.autopilot.final_bf16=0.1",
        "trainer.val_check_interval=0",
    ]
    whole = net_run(tmp_path, "whole", "ActivationOutlier", "fp8", 60, *pilot)
    with monkeypatch.context() as m:
        signal_in_step(m, at, "SIGTERM")
        with pytest.raises(Preempted):
            net_run(tmp_path, "parts", "ActivationOutlier", "fp8", 60, *pilot)
    parts = net_run(
        tmp_path, "parts", "ActivationOutlier", "fp8", 60, *pilot, "trainer.resume=auto"
    )
    assert switched(parts) == switched(whole)
    assert {s for s, _, _ in switched(whole)} == {K + 1, 55}
    assert [r["loss"] for r in read_metrics(tmp_path / "parts")] == [
        r["loss"] for r in read_metrics(tmp_path / "whole")
    ]
    a, b = load_last(tmp_path / "whole"), load_last(tmp_path / "parts")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
