"""The loss scaler beyond GradScaler (runner/precision/scaler.py): hysteresis, a floor where the
run stops, a cap on growth; on the device, checkpointed, in fp16, fp16_master, staged and FSDP.
Each test reads the scale each step really carried (metrics.jsonl) or the checkpoint."""

from __future__ import annotations

import json
import re

import pytest
import torch

from runner.config import GradScalerConfig
from runner.config.validation import validate
from runner.errors import UserError
from runner.precision import mode_of
from runner.precision.scaler import LossScaler
from runner.precision.step import optimizer_step
from runner.run import run
from tests.helpers import TINY_MLP, cli, load_last, make_cfg, read_metrics
from tests.test_distributed import FSDP_MLP, run_ranks

S = 2.0**100  # the tiny MLP's fp16 gradients overflow at this scale, on every step
RUN = [*TINY_MLP, "trainer.log_every_n_steps=1", "trainer.val_check_interval=0"]
STAGED = [
    "precision=staged",
    "precision.stages=[{mode:fp16,until_step:2},{mode:bf16,until_step:3},{mode:fp16}]",
]


def scales(run_dir) -> list[float]:
    return [r["loss_scale"] for r in read_metrics(run_dir)]


@pytest.mark.parametrize(
    "mode, expected",
    [
        (["precision=fp16"], [S, S, S, S / 2, S / 4]),
        (["precision=fp16_master"], [S, S, S, S / 2, S / 4]),
        # The bf16 stage carries no scale (1.0), and the count waits through it, dormant.
        (STAGED, [S, S, 1.0, S, S / 2]),
    ],
    ids=["fp16", "fp16_master", "staged"],
)
def test_hysteresis_keeps_the_scale_through_its_first_overflows(tmp_path, mode, expected):
    """hysteresis=3: two overflows skip their steps at the scale they came at; the third, and
    every one after it until the scale grows, backs off (GradScaler's 1 backs off at each)."""
    cfg = make_cfg(
        *RUN,
        *mode,
        f"precision.grad_scaler.init_scale={S}",
        "precision.grad_scaler.hysteresis=3",
        "trainer.max_steps=5",
    )
    run(cfg, tmp_path)
    rows = read_metrics(tmp_path)
    assert [r["loss_scale"] for r in rows] == expected
    assert [r["skipped"] for r in rows] == [s != 1.0 for s in expected]


def test_the_count_starts_again_once_the_scale_grows():
    """Megatron's rule, on a real GradScaler and SGD, an overflow made by hand: hysteresis=2 and
    growth_interval=2; an overflow is tolerated, the next backs off, two clean steps grow the
    scale and restore the tolerance."""
    cfg = GradScalerConfig(init_scale=1024.0, growth_interval=2, hysteresis=2)
    scaler = LossScaler(cfg, torch.device("cpu"), sharded=False, modes=["fp16"])
    scaler.enter(mode_of("fp16"))
    weight = torch.nn.Parameter(torch.ones(2))
    sgd = torch.optim.SGD([weight], lr=0.1)
    carried = []
    for overflow in (True, True, False, False, True, False):
        scaler.scale((weight * 1.0).sum()).backward()
        if overflow:
            weight.grad[0] = float("inf")
        carried.append(float(optimizer_step([sgd], [weight], scaler, None).loss_scale))
        sgd.zero_grad()
    # tolerated, backs off, clean, clean (grows: 512 → 1024), tolerated again, clean
    assert carried == [1024.0, 1024.0, 512.0, 512.0, 1024.0, 1024.0]


def test_max_scale_caps_growth(tmp_path):
    cfg = make_cfg(
        *RUN,
        "precision=fp16",
        "precision.grad_scaler.init_scale=1024",
        "precision.grad_scaler.growth_interval=1",  # GradScaler doubles it on each clean step
        "precision.grad_scaler.max_scale=4096",
        "trainer.max_steps=5",
    )
    run(cfg, tmp_path)
    assert scales(tmp_path) == [1024.0, 2048.0, 4096.0, 4096.0, 4096.0]
    assert load_last(tmp_path)["scaler"]["scale"] == 4096.0


def test_a_resumed_run_continues_the_hysteresis_count(tmp_path):
    """Stopped after two tolerated overflows and resumed: the third backs off, as in the run
    that went straight through (a count started afresh would tolerate two more)."""
    common = [*RUN, "precision=fp16", f"precision.grad_scaler.init_scale={S}"]
    common.append("precision.grad_scaler.hysteresis=3")
    run(make_cfg(*common, "trainer.max_steps=5"), tmp_path / "straight")
    run(make_cfg(*common, "trainer.max_steps=2"), tmp_path / "resumed")
    assert load_last(tmp_path / "resumed")["scaler"]["tolerated"] == 0
    run(make_cfg(*common, "trainer.max_steps=5", "trainer.resume=auto"), tmp_path / "resumed")
    assert scales(tmp_path / "resumed") == scales(tmp_path / "straight") == [S, S, S, S / 2, S / 4]


def test_a_resumed_run_takes_the_scaler_settings_from_the_config_and_the_scale_from_the_checkpoint(
    tmp_path,
):
    """fp16 health's advice is taken by resuming with the new setting: three clean steps at
    growth_interval=100 (no growth), then resumed at growth_interval=2. The scale carries (1024);
    the count of 3 clean steps is past the new interval, so the next clean step grows it, and
    the new checkpoint holds the config's settings (the checkpoint's interval would never grow)."""
    common = [*RUN, "precision=fp16", "precision.grad_scaler.init_scale=1024"]
    first = ["precision.grad_scaler.growth_interval=100", "trainer.max_steps=3"]
    run(make_cfg(*common, *first), tmp_path)
    assert load_last(tmp_path)["scaler"]["_growth_tracker"] == 3
    changed = [
        "precision.grad_scaler.growth_interval=2",
        "precision.grad_scaler.growth_factor=4",
        "precision.grad_scaler.backoff_factor=0.25",
    ]
    run(make_cfg(*common, *changed, "trainer.max_steps=6", "trainer.resume=auto"), tmp_path)
    # step 4 grows it (a count at the interval's end), step 6 too (two clean steps later)
    assert scales(tmp_path) == [1024.0] * 4 + [4096.0, 4096.0]
    state = load_last(tmp_path)["scaler"]
    settings = (state["growth_interval"], state["growth_factor"], state["backoff_factor"])
    assert settings == (2, 4.0, 0.25)
    assert state["scale"] == 4 * 4096.0 and state["_growth_tracker"] == 0


def test_a_scale_collapsed_to_its_floor_stops_the_run_with_one_line_and_loses_nothing(tmp_path):
    """min_scale=3S/8: the second overflow backs the scale off to the floor (not to S/4), the
    third comes at it. The command stops with one line and exit 1; summary.json says why; the
    rows, the report and a checkpoint of the last weights are there, and the run resumes from
    it in bf16."""
    out = tmp_path / "run"
    floor = [
        f"precision.grad_scaler.init_scale={S}",
        f"precision.grad_scaler.min_scale={S * 3 / 8}",
    ]
    args = [*RUN, "precision=fp16", *floor, "trainer.max_steps=8"]
    proc = cli(*args, f"hydra.run.dir={out}", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert errors[0].startswith(
        "error: training stopped at step 3: the loss scale collapsed to its floor"
    )
    assert "use bf16 or keep these layers fp32 (nonfinite.json: net." in errors[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "collapsed to its floor" in summary["error"]
    assert summary["steps"] == 3
    assert scales(out) == [S, S / 2, S * 3 / 8] and all(r["skipped"] for r in read_metrics(out))
    assert json.loads((out / "nonfinite.json").read_text())["step"] == 1
    state = load_last(out)
    assert state["step"] == 3 and state["scaler"]["scale"] == S * 3 / 8
    resumed = [*RUN, "precision=bf16", "trainer.max_steps=5", "trainer.resume=auto"]
    run(make_cfg(*resumed, "trainer.resume_across_precision=true"), out)
    rows = read_metrics(out)
    assert [r["precision"] for r in rows] == ["fp16"] * 3 + ["bf16"] * 2
    assert not any(r["skipped"] for r in rows[3:])


def test_fp16_health_advises_a_cap_that_curbs_growth_probing_into_overflows(tmp_path):
    """Growing every 2 steps, the scale keeps probing past where the MLP's gradients overflow;
    the advice names a max_scale, and the run with it skips fewer steps, never above it."""
    probing = [
        *RUN,
        "precision=fp16",
        "precision.grad_scaler.init_scale=131072",
        "precision.grad_scaler.growth_interval=2",
        "trainer.max_steps=20",
    ]
    advice = run(make_cfg(*probing), tmp_path / "a")["fp16_health"]["recommendation"]
    cap = re.search(r"precision\.grad_scaler\.max_scale=(\S+)", advice)
    assert cap, advice
    run(make_cfg(*probing, cap.group(0)), tmp_path / "b")
    skipped = [sum(r["skipped"] for r in read_metrics(tmp_path / d)) for d in "ab"]
    assert skipped[0] > skipped[1] and max(scales(tmp_path / "b")) == float(cap[1])


def test_by_default_every_overflow_backs_off_and_the_run_goes_on(tmp_path):
    """GradScaler's behaviour: hysteresis 1, no floor, no cap."""
    scale = f"precision.grad_scaler.init_scale={S}"
    summary = run(make_cfg(*RUN, "precision=fp16", scale, "trainer.max_steps=4"), tmp_path)
    assert scales(tmp_path) == [S, S / 2, S / 4, S / 8] and summary["status"] == "completed"


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
def test_fsdp_s_sharded_scaler_keeps_the_hysteresis_and_resumes_its_count(tmp_path):
    """Two ranks, FSDP2's ShardedGradScaler (overflows agreed over ranks), a sharded checkpoint
    set: the same scales straight through and resumed after the two tolerated overflows."""
    common = [*FSDP_MLP, "precision=fp16", f"precision.grad_scaler.init_scale={S}"]
    common.append("precision.grad_scaler.hysteresis=3")
    run_ranks(
        [
            ([*common, "trainer.max_steps=5"], tmp_path / "straight"),
            ([*common, "trainer.max_steps=2"], tmp_path / "resumed"),
            ([*common, "trainer.max_steps=5", "trainer.resume=auto"], tmp_path / "resumed"),
        ]
    )
    assert scales(tmp_path / "resumed") == scales(tmp_path / "straight") == [S, S, S, S / 2, S / 4]


@pytest.mark.parametrize(
    "override, message",
    [
        ("precision.grad_scaler.hysteresis=0", "hysteresis=0 is invalid: must be ≥ 1"),
        ("precision.grad_scaler.min_scale=0", "min_scale=0.0 is invalid: must be null or"),
        ("precision.grad_scaler.min_scale=1e6", "min_scale=1000000.0 is invalid"),
        ("precision.grad_scaler.max_scale=1024", "max_scale=1024.0 is invalid: must be null or"),
        ("precision.grad_scaler.max_scale=inf", "max_scale=inf is invalid"),
    ],
)
def test_a_bad_scaler_setting_is_one_line_naming_it(override, message):
    with pytest.raises(UserError, match=message) as e:
        validate(make_cfg(*TINY_MLP, "precision=fp16", override))
    assert "\n" not in str(e.value)
