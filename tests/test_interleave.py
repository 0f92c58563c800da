"""Speed you can trust: runner.speed=interleaved (the precisions timed again side by side, in one
process, in alternating rounds; runner/compare/interleave.py) and steps too small to tell."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest

from runner.compare import compare, interleave
from runner.compare.stats import round_ratio
from runner.config.validation import validate
from runner.errors import UserError
from tests.helpers import TINY_MLP, cli, make_cfg
from tests.test_compare import fake_job

# what one seed within the tolerance cannot exclude, as a verdict says it
ONE_SEED = (
    "its one seed within +2%: a seed beyond it up to 95% of the time is not ruled out at 95%; "
    "29 such seeds would rule out 10%"
)


def interleaved_timing(configs: dict, bf16: float) -> dict:
    """What `interleave.time_configs` gives for `configs` with fp32 at 100 samples/s and bf16 at
    `bf16` (IQR 4 over 3 rounds), by the configs' keys."""

    def figures(speed: float) -> dict:
        rounds = [speed - 4, speed, speed + 4]
        return {
            "samples_per_s": speed,
            "samples_per_s_iqr": 4.0,
            "samples_per_s_rounds": rounds,
            "step_time_s": 64 / speed,
            "peak_memory_mb": 1.0,
        }

    speeds = {"fp32": 100.0, "bf16": bf16}
    return {key: figures(speeds[cfg.precision.mode]) for key, cfg in configs.items()}


@pytest.mark.parametrize(
    "bf16, speedup, verdict",
    [
        (
            103.0,
            1.03,
            "1.03× faster (interleaved timing) within the speed spread, 1.03× faster to the "
            "target (1.00× the steps; one seed), eval loss within 0.00% of fp32 (one seed: "
            "untested against seed noise; its one seed within +2%: a seed beyond it up to 95% of "
            "the time is not ruled out at 95%; 29 such seeds would rule out 10%) — no measurable "
            "difference",
        ),
        (
            130.0,
            1.30,
            "1.30× faster (interleaved timing), 1.30× faster to the target (1.00× the steps; one "
            "seed), eval loss within 0.00% of fp32 (one seed: untested against seed noise; its one "
            "seed within +2%: a seed beyond it up to 95% of the time is not ruled out at 95%; 29 "
            "such seeds would rule out 10%) — recommended",
        ),
    ],
)
def test_interleaved_figures_decide_and_the_verdict_says_so(
    tmp_path, monkeypatch, bf16, speedup, verdict
):
    """runner.speed=interleaved (from the sweep's config): the speed of the precisions timed
    again side by side replaces the jobs' own (1.50× faster, each with an IQR of 1)."""
    runner = {"speed": "interleaved", "speed_rounds": 2, "speed_steps": 3}
    fake_job(tmp_path / "0", "fp32", speed=100.0, iqr=1.0, runner=runner)
    fake_job(tmp_path / "1", "bf16", speed=150.0, iqr=1.0, runner=runner)
    asked = []

    def time_configs(configs, rounds, steps):
        asked.append(([c.precision.mode for c in configs.values()], rounds, steps))
        return interleaved_timing(configs, bf16)

    monkeypatch.setattr(interleave, "time_configs", time_configs)
    fp32, group = compare(tmp_path, wandb_log=False)
    assert asked == [(["fp32", "bf16"], 2, 3)]  # once, each built from its job's config
    row = {r["label"]: r for r in json.loads((tmp_path / "compare.json").read_text())}["bf16"]
    assert row["speed_source"] == "interleaved" and row["samples_per_s"] == bf16
    assert row["samples_per_s_iqr"] == 4.0
    assert row["samples_per_s_rounds"] == [bf16 - 4, bf16, bf16 + 4]
    # the per-round ratios, each order weighted alike
    assert row["speedup"] == pytest.approx(round_ratio(row["samples_per_s_rounds"], [96, 100, 104]))
    assert row["speedup"] == pytest.approx(speedup, abs=5e-4)
    assert group.verdict == verdict
    faster = bf16 > 104  # beyond the two IQRs added
    assert fp32.verdict == "baseline" + ("" if faster else " — recommended: no mode is faster here")
    compare(tmp_path, wandb_log=False, speed="jobs")  # --speed jobs: each job's own figures
    row = json.loads((tmp_path / "compare.json").read_text())[1]
    assert row["speed_source"] == "jobs" and row["samples_per_s_rounds"] is None
    assert row["verdict"].startswith("1.50× faster (per-job timing), ")


def test_interleaved_timing_times_every_row_and_staged_stage_by_stage(tmp_path, monkeypatch):
    """Rows that differ in a precision.* key are each timed (not the first per precision), and
    a staged row (fp32 for 5 of its 20 steps, then bf16) is timed stage by stage, its speed
    each round's samples over the time its stages take for their shares of the steps."""
    runner = {"speed": "interleaved", "speed_rounds": 3, "speed_steps": 3}
    stages = {"precision": {"stages": [{"mode": "fp32", "until_step": 5}, {"mode": "bf16"}]}}
    fake_job(tmp_path / "0", "fp32", runner=runner)
    for i, scale in enumerate((1.0, 2.0)):
        grad_scaler = {"precision": {"grad_scaler": {"init_scale": scale}}}
        fake_job(tmp_path / str(1 + i), "bf16", runner=runner, config=grad_scaler)
    fake_job(tmp_path / "3", "staged", runner=runner, config=stages)
    asked = []

    def time_configs(configs, rounds, steps):
        asked.append([c.precision.mode for c in configs.values()])
        return interleaved_timing(configs, 150.0)

    monkeypatch.setattr(interleave, "time_configs", time_configs)
    fp32, bf16_a, bf16_b, staged = compare(tmp_path, wandb_log=False)
    assert asked == [["fp32", "bf16", "bf16", "fp32", "bf16"]]
    assert {g.figures["speed_source"] for g in (bf16_a, bf16_b, staged)} == {"interleaved"}
    expected = [1 / (0.25 / (100 + d) + 0.75 / (150 + d)) for d in (-4, 0, 4)]
    assert staged.figures["samples_per_s_rounds"] == pytest.approx(expected)
    assert staged.figures["samples_per_s"] == pytest.approx(expected[1])
    assert staged.figures["step_time_s"] == pytest.approx(0.25 * 0.64 + 0.75 * 64 / 150)
    assert staged.figures["speedup"] == pytest.approx(round_ratio(expected, [96, 100, 104]))


def test_an_interleaved_timing_that_fails_leaves_the_jobs_figures(tmp_path, monkeypatch, capsys):
    fake_job(tmp_path / "0", "fp32", speed=100.0)
    fake_job(tmp_path / "1", "bf16", speed=150.0)

    def time_configs(configs, rounds, steps):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(interleave, "time_configs", time_configs)
    compare(tmp_path, wandb_log=False, speed="interleaved")
    said = capsys.readouterr().err  # runner.console: stderr
    assert "interleaved timing failed (out of memory): the jobs' speed is used" in said
    row = json.loads((tmp_path / "compare.json").read_text())[1]
    assert row["speed_source"] == "jobs" and row["speedup"] == 1.5


@pytest.mark.parametrize("flops, small", [(4e9, True), (6e9, False)])
def test_a_step_too_small_to_tell_is_never_recommended(tmp_path, flops, small):
    """fp32's step bounds what a precision can gain: its FLOPs at 1 TFLOP/s take 4% of its 0.1 s
    (under MIN_MATMUL_SHARE, 5%) or 6%. bf16's own share (at a 100× higher peak) does not decide."""
    fp32 = {"flops_per_step": flops, "step_time_s": 0.1, "peak_tflops": 1.0, "mfu": flops / 1e11}
    fake_job(tmp_path / "0", "fp32", speed=100.0, iqr=1.0, summary=fp32)
    bf16 = fp32 | {"step_time_s": 0.1 / 1.5, "peak_tflops": 100.0, "mfu": flops * 1.5 / 1e13}
    fake_job(tmp_path / "1", "bf16", speed=150.0, iqr=1.0, summary=bf16)
    base, group = compare(tmp_path, wandb_log=False)
    rows = json.loads((tmp_path / "compare.json").read_text())
    assert [r["too_small_to_tell"] for r in rows] == [small, small]
    assert rows[1]["mfu"] == pytest.approx(flops * 1.5 / 1e13)  # its own, under 5%: no matter
    loss = "eval loss within 0.00% of fp32 (one seed: untested against "
    notes = (tmp_path / "compare.md").read_text().partition("Notes:")[2]
    assert "\n- target: eval loss ≤ 2.0400 " in notes  # and the setting's own note, if any
    notes = "".join(f"\n{n}" for n in notes.splitlines() if n.startswith("- fp32"))
    if small:  # a step too small to tell: only the steps to the target are told
        start = f"1.50× faster (per-job timing), 1.00× the steps to the target (one seed), {loss}"
        tail = "too small to tell: fp32's FLOPs are 4.00% of its step at peak"
        assert group.verdict == f"{start}seed noise; {ONE_SEED}) — {tail}"
        assert base.verdict == "baseline — recommended: no mode is shown to be faster here"
        assert notes.count("\n- ") == 1 and rows[0]["note"] == rows[1]["note"]
        note = "- fp32: a step too small to tell the precisions apart by speed — its 4e+09 FLOPs "
        assert (
            note + "would take 4.00% of its 100 ms step at the device's fp32 matmul peak" in notes
        )
    else:
        start = "1.50× faster (per-job timing), 1.50× faster to the target (1.00× the steps; one "
        assert group.verdict == f"{start}seed), {loss}seed noise; {ONE_SEED}) — recommended"
        assert not notes
        assert rows[1]["note"] is None


def test_rounds_alternate_the_order_of_the_variants():
    order = []
    timers = {key: (lambda key=key: order.append(key) or len(order)) for key in "abc"}
    results = interleave.alternate(timers, 3)
    assert order == list("abccbaabc")
    assert results == {"a": [1, 6, 7], "b": [2, 5, 8], "c": [3, 4, 9]}
    # each order weighted alike: √(2·4), where the median would follow the majority order, 2
    assert round_ratio([2.0, 4.0, 2.0], [1.0, 1.0, 1.0]) == pytest.approx(8**0.5)


@pytest.mark.parametrize(
    "override, message",
    [
        ("runner.speed=fast", "runner.speed='fast' is invalid: jobs or interleaved"),
        ("runner.speed_rounds=1", "runner.speed_rounds=1 is invalid: must be ≥ 2"),
        ("runner.speed_steps=0", "runner.speed_steps=0 is invalid: must be ≥ 1"),
    ],
)
def test_bad_speed_settings_are_one_clear_error(override, message):
    with pytest.raises(UserError) as e:
        validate(make_cfg(*TINY_MLP, override))
    assert str(e.value) == message


def test_runner_speed_interleaved_times_the_precisions_again_side_by_side(tmp_path):
    """The tiny MLP in fp32 and bf16, then both timed again in the sweep's process: the verdict
    uses those figures (two rounds of two steps each), not the jobs' own."""
    sweep = tmp_path / "sweep"
    proc = cli(
        "-m",
        "precision=fp32,bf16",
        *TINY_MLP,
        "trainer.max_steps=4",
        "trainer.benchmark.warmup_steps=1",  # a steady window: the jobs' own speed too
        "runner.speed=interleaved",
        "runner.speed_rounds=2",
        "runner.speed_steps=2",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "timing fp32, bf16 again (the sweep): 2 interleaved rounds of 2 steps" in proc.stderr
    rows = {r["precision"]: r for r in json.loads((sweep / "compare.json").read_text())}
    for precision, job in (("fp32", "0"), ("bf16", "1")):
        row, summary = rows[precision], json.loads((sweep / job / "summary.json").read_text())
        rounds = row["samples_per_s_rounds"]
        assert row["speed_source"] == "interleaved" and len(rounds) == 2
        assert row["samples_per_s"] == pytest.approx(statistics.median(rounds))
        assert row["samples_per_s"] != summary["samples_per_s"]
        at_peak = summary["flops_per_step"] / (summary["peak_tflops"] * 1e12)
        assert row["mfu"] == pytest.approx(at_peak / row["step_time_s"])  # by the new step time
        assert row["samples_per_s_iqr"] == pytest.approx(
            np.subtract(*np.percentile(rounds, [75, 25]))
        )
    bf16, fp32 = rows["bf16"]["samples_per_s_rounds"], rows["fp32"]["samples_per_s_rounds"]
    ratios = [b / f for b, f in zip(bf16, fp32, strict=True)]  # each round's pair
    assert rows["bf16"]["speedup"] == pytest.approx(np.exp(np.mean(np.log(ratios))))  # 2 rounds
    assert "(interleaved timing)" in rows["bf16"]["verdict"]


def test_an_auto_sweeps_later_looks_read_back_the_first_looks_timing(tmp_path, monkeypatch):
    """runner.seeds=auto with runner.speed=interleaved: the first look times the rows and keeps
    the timing in the sweep folder; a later look (a later round's jobs there) reads it back and
    times nothing, so a row its speed decided stays decided (runner/compare/seeds.py)."""
    runner = {"seeds": "auto", "max_seeds": 4, "speed": "interleaved", "speed_rounds": 3}
    for seed in range(3):
        fake_job(tmp_path / str(seed), "fp32", seed=seed, runner=runner)
        fake_job(tmp_path / str(3 + seed), "bf16", seed=seed, speed=150.0, runner=runner)
    asked = []

    def time_configs(configs, rounds, steps):
        asked.append(len(asked))
        return interleaved_timing(configs, 130.0 if len(asked) == 1 else 90.0)

    monkeypatch.setattr(interleave, "time_configs", time_configs)
    first = {g.label: g.figures["speedup"] for g in compare(tmp_path, False, look=set())}
    assert asked == [0] and (tmp_path / "seeds_auto_timing.json").exists()
    fake_job(tmp_path / "seed3-0", "fp32", seed=3, runner=runner)
    fake_job(tmp_path / "seed3-1", "bf16", seed=3, speed=150.0, runner=runner)
    later = {g.label: g.figures for g in compare(tmp_path, False, look={3})}
    assert asked == [0]  # read back: timed once
    assert later["bf16"]["speedup"] == first["bf16"] and later["bf16"]["seeds"] == 4
    assert later["bf16"]["speed_source"] == "interleaved"
