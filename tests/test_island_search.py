"""The fp32 islands search (runner/answers/island_search.py): a net with one layer whose
activations pass fp16's 65504 trains in fp16 once that layer is found and kept in fp32; a net
that overflows in more layers than `runner.islands_max` gets "no small set: use bf16"; a run
that ends finite but overflows on the way, or skips steps once its loss scale settled, does not
train (as fp32 does) yet."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from runner.answers.island_criteria import calibration, loss_fault, range_fault
from runner.answers.island_search import search
from runner.compare import compare, interleave
from runner.config.validation import validate
from runner.errors import UserError
from runner.run import run
from tests.helpers import load_last, make_cfg, module_run, read_metrics
from tests.test_compare import fake_job

REPO = Path(__file__).resolve().parents[1]


class Amplify(nn.Linear):
    """A Linear whose output is × 1e5: past fp16's largest value (65504) wherever |y| > 0.66."""

    def forward(self, x):
        return super().forward(x) * 1e5


class Loud(nn.Module):
    """`blocks` blocks of Amplify → LayerNorm, and a head: each Amplify overflows fp16, and the
    LayerNorm after it brings the activations back to unit scale."""

    def __init__(self, blocks: int = 1, width: int = 16, features: int = 8, outputs: int = 3):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.Sequential(
            *(nn.Sequential(Amplify(width, width), nn.LayerNorm(width)) for _ in range(blocks))
        )
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


class Spiky(nn.Linear):
    """Amplify only on a batch holding an |x| > 3 (step 6 of the 8 on tests/test_own_model.py's
    pairs): a run skips that step and ends finite."""

    def forward(self, x):
        return super().forward(x) * (1e5 if x.abs().max() > 3 else 1.0)


class Sometimes(nn.Module):
    def __init__(self, width: int = 16, features: int = 8, outputs: int = 3):
        super().__init__()
        self.inp = Spiky(features, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        return self.head(self.norm(self.inp(x)))


LOUD = "tests.test_island_search.Loud"
SOMETIMES = "tests.test_island_search.Sometimes"
# Short trials: 8 steps; a run stops after 3 non-finite steps in a row.
SHORT = ["runner.islands_steps=8", "trainer.max_steps=8", "trainer.max_consecutive_nonfinite=3"]


def loud(*overrides: str):
    return make_cfg(*module_run(LOUD, "precision=fp16", *SHORT, *overrides))


def amplify_flop_share(width: int = 16, features: int = 8, outputs: int = 3) -> float:
    """The share of one training step's matmul FLOPs in Loud(blocks=1)'s Amplify: forward, and in
    backward the weight's gradient and the input's (the first Linear's input, the data, needs
    none)."""
    first, amplify, head = features * width, width * width, width * outputs
    return 3 * amplify / (2 * first + 3 * amplify + 3 * head)


def test_the_layer_that_overflows_fp16_is_found_and_the_net_trains_with_it_in_fp32(tmp_path):
    result = search(loud(), tmp_path / "search")
    assert result["found"] and result["fp32_modules"] == ["net.blocks.0.0"]
    assert result["config"] == "precision.fp32_modules=[net.blocks.0.0]"
    written = json.loads((tmp_path / "search" / "islands.json").read_text())
    assert written["config"] == result["config"] and len(written["trials"]) == 4
    # What the runs did: without the island every step overflowed and the run stopped.
    baseline = read_metrics(tmp_path / "search" / "trial-0")
    assert len(baseline) == 3 and all(r["skipped"] for r in baseline)
    # The config line it prints trains in fp16: no step skipped, the loss of fp32's run.
    run(loud("precision.fp32_modules=[net.blocks.0.0]"), tmp_path / "fp16")
    run(loud("precision=fp32"), tmp_path / "fp32")
    rows, reference = read_metrics(tmp_path / "fp16"), read_metrics(tmp_path / "fp32")
    assert len(rows) == 8 and not any(r["skipped"] for r in rows)
    assert rows[-1]["loss"] == pytest.approx(reference[-1]["loss"], rel=1e-2)
    assert result["final_loss"] == pytest.approx(rows[-1]["loss"], rel=1e-6)
    assert result["fp32_final_loss"] == pytest.approx(reference[-1]["loss"], rel=1e-6)
    # The island's cost: its share of the step's FLOPs, which ran in fp32.
    assert result["fp32_flop_share"] == pytest.approx(amplify_flop_share())


def test_a_run_that_overflows_on_the_way_but_ends_finite_gets_its_island(tmp_path):
    """Ending finite is not training: the NaN loss of step 6 is replayed (on the weights a run to
    step 6 holds) and its module kept in fp32; then fp16 trains as fp32 does."""
    result = search(make_cfg(*module_run(SOMETIMES, "precision=fp16", *SHORT)), tmp_path)
    assert result["found"] and result["fp32_modules"] == ["net.inp"]
    first, rerun, replay, confirmed, fp32 = result["trials"]
    assert first["skipped_steps"] == 1 and math.isfinite(first["final_loss"])
    assert not first["trains"] and first["fault"] == "non-finite loss at step 6"
    assert rerun["kind"] == "rerun" and rerun["steps"] == 6 and rerun["for_step"] == 6
    assert replay["step"] == 6 and replay["finite"]
    assert confirmed["trains"] and confirmed["skipped_steps"] == 0
    assert result["final_loss"] == pytest.approx(result["fp32_final_loss"], rel=1e-2)


def _rows(*steps: tuple[bool, float, float]) -> list[dict]:
    return [
        {"step": i, "skipped": s, "loss": loss, "loss_scale": scale}
        for i, (s, loss, scale) in enumerate(steps, 1)
    ]


def test_trains_as_fp32_does_allows_the_first_calibration_alone():
    """The scaler's first back-off is allowed; skipped steps once it settled (past 5%), a
    non-finite loss anywhere, or a loss 5% off fp32's are not (BERT with initializer_range=10
    and four islands ended finite: 5 of its 10 settled steps skipped)."""
    nan = float("nan")
    calibrating = [(True, 6.0, 65536.0), (True, 6.0, 32768.0), (True, 6.0, 16384.0)]
    settled = [(False, 6.0, 8192.0)] * 20
    assert calibration(_rows(*calibrating, *settled)) == 3
    assert range_fault(_rows(*calibrating, *settled)) is None
    assert range_fault(_rows(*calibrating, *settled[:19], (True, 6.0, 8192.0))) is None  # 1 of 20
    two = _rows(*calibrating, *settled[:9], (True, 6.0, 8192.0), *settled[:9], (True, 6.0, 4096.0))
    assert range_fault(two) == (
        "2 of 20 steps skipped after the loss scale's first calibration (steps 1-3)",
        13,
    )
    # A scale that backs off to the end never settled: every step counts.
    assert calibration(_rows(*calibrating)) == 0
    assert range_fault(_rows(*calibrating)) == ("3 of 3 steps skipped", 1)
    assert range_fault(_rows(calibrating[0], (True, nan, 32768.0), *settled)) == (
        "non-finite loss at step 2",
        2,
    )
    # No scaler (bf16): a skipped step at scale 1 is no calibration.
    assert calibration(_rows((True, 6.0, 1.0), (False, 6.0, 1.0))) == 0
    fp32 = _rows(*[(False, 5.0, 1.0)] * 23)
    assert loss_fault(_rows(*calibrating, *[(False, 5.2, 8192.0)] * 20), fp32) is None
    assert loss_fault(_rows(*calibrating, *[(False, 5.3, 8192.0)] * 20), fp32) == (
        "mean loss 5.3 against fp32's 5 over steps 4-23 (more than 5% apart)"
    )


def test_a_net_that_overflows_in_more_layers_than_islands_max_has_no_small_set(tmp_path):
    result = search(loud("+model.net.blocks=4", "runner.islands_max=2"), tmp_path)
    assert not result["found"]
    assert result["verdict"].startswith("no small set: use bf16")
    assert result["fp32_modules"] == ["net.blocks.0.0", "net.blocks.1.0"]
    replays = [t for t in result["trials"] if t["kind"] == "replay"]
    assert [t["first_nonfinite"] for t in replays] == ["net.blocks.1.0", "net.blocks.2.0"]


def test_auto_searches_then_trains_with_the_islands_and_a_resumed_run_keeps_them(tmp_path):
    summary = run(loud("precision.fp32_modules=auto"), tmp_path)
    assert summary["status"] == "completed"
    assert summary["fp32_islands"]["fp32_modules"] == ["net.blocks.0.0"]
    assert (tmp_path / "islands" / "islands.json").is_file()
    rows = read_metrics(tmp_path)
    assert len(rows) == 8 and not any(r["skipped"] for r in rows)
    assert load_last(tmp_path)["config"]["precision"]["fp32_modules"] == ["net.blocks.0.0"]
    # Resumed: the checkpoint's islands, no second search, and fp16 still trains.
    shutil.rmtree(tmp_path / "islands")
    more = ["trainer.max_steps=12", "trainer.resume=auto"]
    resumed = run(loud("precision.fp32_modules=auto", *more), tmp_path)
    assert resumed["status"] == "completed" and not (tmp_path / "islands").exists()
    assert resumed["skipped_steps"] == 0 and len(read_metrics(tmp_path)) == 12


def test_auto_without_a_small_set_stops_with_one_line(tmp_path):
    cfg = loud("precision.fp32_modules=auto", "+model.net.blocks=3", "runner.islands_max=1")
    with pytest.raises(UserError, match=r"^precision.fp32_modules=auto: no small set: use bf16"):
        run(cfg, tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


def test_the_search_refuses_a_mode_that_computes_in_fp32(tmp_path):
    with pytest.raises(UserError, match="needs a low-precision mode: precision=fp32"):
        search(loud("precision=fp32"), tmp_path)


@pytest.mark.parametrize(
    "override, message",
    [
        ("precision.fp32_modules=net.0", "precision.fp32_modules='net.0' is invalid: a list"),
        ("precision.fp32_modules=7", "precision.fp32_modules=7 is invalid: a list"),
        ("runner.islands_max=0", "runner.islands_max=0 is invalid: must be ≥ 1"),
        ("runner.islands_steps=0", "runner.islands_steps=0 is invalid: must be ≥ 1"),
    ],
)
def test_bad_values_are_one_clear_line(override, message):
    with pytest.raises(UserError, match=re.escape(message)):
        validate(loud(override))


@pytest.mark.parametrize("command", ["runner.islands", "runner.recipe"])
def test_the_command_prints_the_trials_and_writes_islands_json(tmp_path, command):
    """python -m runner.islands, and python -m runner.recipe's fp16 case, which it is."""
    out = tmp_path / "search"
    args = [*module_run(LOUD, "precision=fp16", *SHORT), f"hydra.run.dir={out}"]
    proc = subprocess.run(
        [sys.executable, "-m", command, *args],
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "precision.fp32_modules=[net.blocks.0.0]" in proc.stdout.splitlines()[-1]
    assert "| fp16 run (trial-0) | none | stops at step 3" in proc.stdout
    assert json.loads((out / "islands.json").read_text())["found"]
    bad = subprocess.run(
        [sys.executable, "-m", command, "-m", *args],
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode == 2 and bad.stderr.startswith(f"error: python -m {command} searches")


def test_an_auto_job_is_timed_again_with_the_islands_its_search_found(tmp_path, monkeypatch):
    """runner.speed=interleaved builds each row from its job's config: `auto` there stands for
    the islands in the job's summary."""
    runner = {"speed": "interleaved", "speed_rounds": 2, "speed_steps": 3}
    fake_job(tmp_path / "0", "fp32", runner=runner)
    found = {"fp32_islands": {"fp32_modules": ["net.blocks.0.0"]}}
    auto = {"precision": {"fp32_modules": "auto"}}
    fake_job(tmp_path / "1", "fp16", runner=runner, config=auto, summary=found)
    asked = []

    def time_configs(configs, rounds, steps):
        asked.extend(list(c.precision.get("fp32_modules", [])) for c in configs.values())
        figures = {"samples_per_s": 100.0, "samples_per_s_iqr": 1.0, "step_time_s": 0.1}
        rounds = {"samples_per_s_rounds": [100.0] * rounds, "peak_memory_mb": 1.0}
        return dict.fromkeys(configs, figures | rounds)

    monkeypatch.setattr(interleave, "time_configs", time_configs)
    compare(tmp_path, wandb_log=False)
    assert asked == [[], ["net.blocks.0.0"]]
