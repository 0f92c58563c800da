"""Time to target (issue 31): the step, tokens and time at which a row's smoothed eval curve
reaches the target, over seeds with an interval, against the baseline's, and the verdict that
ranks by it. Synthetic run folders, whose truth is known, and no training."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from runner.compare import compare, crossing, dashboard, target
from runner.compare.jobs import load_sweep
from runner.compare.stats import t_quantile
from runner.compare.sweep import analyse, group

BATCH = 8  # samples a step
STEPS = 100


def job(
    folder: Path,
    precision: str,
    curve: Callable[[int], float],
    step_time: float,
    seed: int = 0,
    every: int = 5,
    metric: str = "eval_loss",
    config: dict | None = None,
) -> None:
    """A finished job: STEPS steps of `step_time` s, BATCH samples (of 16 tokens) each,
    evaluated every `every` steps on `curve(step)`; its speed's spread 1% of it."""
    speed = BATCH / step_time
    rows = []
    for step in range(1, STEPS + 1):
        row = {"step": step, "loss": curve(step), "loss_scale": 1.0, "step_time_s": step_time}
        row |= {"samples_per_s": speed, "tokens_per_s": 16 * speed}
        if step % every == 0 or step == STEPS:
            row[metric] = curve(step)
        rows.append(row)
    last_eval = rows[-1][metric]
    summary = {
        "status": "completed",
        "precision": precision,
        "final_loss": rows[-1]["loss"],
        metric: last_eval,
        "samples_per_s": speed,
        "samples_per_s_iqr": 0.01 * speed,
        "tokens_per_s": 16 * speed,
        "step_time_s": step_time,
        "steps": STEPS,
        "skipped_steps": 0,
        "peak_memory_mb": 100.0,
    }
    if metric != "eval_loss":
        summary["eval_loss"] = 1.0  # the loss gap's, the same in every row
    (folder / ".hydra").mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"precision": {"mode": precision}, "seed": seed, "model": {"_target_": "a.MLP"}}
    cfg = OmegaConf.merge(OmegaConf.create(cfg), OmegaConf.create(config or {}))
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    OmegaConf.save(
        OmegaConf.create([f"precision={precision}"]), folder / ".hydra" / "overrides.yaml"
    )


def line(start: float, slope: float, floor: float = -math.inf) -> Callable[[int], float]:
    return lambda step: max(floor, start - slope * step)


def rows_of(root: Path) -> dict[str, dict]:
    return {r["label"]: r for r in json.loads((root / "compare.json").read_text())}


def test_a_mode_that_converges_per_step_like_fp32_is_its_step_speedup_faster_to_the_target(
    tmp_path,
):
    """The same eval curve per step (3 − s/50, every 5 steps: the target, fp32's final 1.0
    +2%, is crossed at step 99 exactly), 1.25× the step speed: 1.25× faster to the target, at
    99 × each step time; timed interleaved, the interleaved step times decide instead."""
    curve = line(3.0, 1 / 50)
    job(tmp_path / "0", "fp32", curve, step_time=0.010)
    job(tmp_path / "1", "bf16", curve, step_time=0.008)
    fp32, bf16 = compare(tmp_path, wandb_log=False)
    f, b = bf16.figures, fp32.figures
    assert (
        b["target"] == pytest.approx(1.02) and "fp32's final eval loss 1.0000" in b["target_from"]
    )
    assert f["steps_to_target"] == pytest.approx(99.0) == b["steps_to_target"]
    assert f["samples_to_target"] == pytest.approx(99 * BATCH)
    assert f["tokens_to_target"] == pytest.approx(99 * BATCH * 16)
    assert f["time_to_target_s"] == pytest.approx(99 * 0.008)
    assert f["wall_time_to_target_s"] == pytest.approx(99 * 0.008)  # the run's own clock
    assert f["time_source"] == "jobs" and f["target_status"] == "reached"
    assert f["time_to_target_speedup"] == pytest.approx(f["speedup"]) == pytest.approx(1.25)
    assert f["steps_to_target_ratio"] == pytest.approx(1.0)
    assert bf16.verdict.startswith(
        "1.25× faster (per-job timing), 1.25× faster to the target (1.00× the steps; one seed)"
    )
    assert bf16.verdict.endswith("— recommended")
    md = (tmp_path / "compare.md").read_text()
    assert "| time to target | to target | steps to target | steps ratio | tokens to target |" in md
    assert "| 0.792 s | 1.25× | 99.0 | 1.00× | 12672 |" in md
    assert "target: eval loss ≤ 1.0200" in md

    # Interleaved: 1.1× by the rounds' step times, not the jobs' own.
    groups = group(load_sweep(tmp_path))
    timing = {"samples_per_s_iqr": 1.0}
    timings = {
        groups[0].key: timing
        | {"samples_per_s": 800, "step_time_s": 0.011, "samples_per_s_rounds": [800] * 3},
        groups[1].key: timing
        | {"samples_per_s": 880, "step_time_s": 0.010, "samples_per_s_rounds": [880] * 3},
    }
    fp32, bf16 = analyse(groups, timings=timings)
    assert bf16.figures["time_source"] == "interleaved"
    assert bf16.figures["time_to_target_s"] == pytest.approx(99 * 0.010)
    assert bf16.figures["time_to_target_speedup"] == pytest.approx(1.1)
    assert "× the interleaved timing's step time" in bf16.figures["target_note"]


def test_a_mode_that_stalls_never_reaches_the_target_and_is_never_recommended(tmp_path, capsys):
    """bf16_true with plain updates at a tiny learning rate stalls (its eval loss stays at 2.9)
    while fp32 moves: not reached, with how close it came, however fast its steps. With a target
    of the user's own (compare.target=1.0), a mode whose final loss is within the 2% tolerance
    of fp32's but above the target is refused for the target alone."""
    job(tmp_path / "a" / "0", "fp32", line(3.0, 1 / 50), step_time=0.010)
    job(tmp_path / "a" / "1", "bf16_true", line(3.0, 0.001), step_time=0.005)
    fp32, stalled = compare(tmp_path / "a", wandb_log=False)
    f = stalled.figures
    assert f["target_status"] == "not reached" and f["target_seeds_reached"] == 0
    assert f["target_closest"] == pytest.approx(2.9, abs=1e-3)
    assert math.isnan(f["time_to_target_s"]) and math.isnan(f["time_to_target_speedup"])
    assert "not recommended" in stalled.verdict and f["speedup"] == pytest.approx(2.0)
    assert fp32.verdict == (
        "baseline — recommended: no mode is faster here but bf16_true, not recommended"
    )
    md = (tmp_path / "a" / "compare.md").read_text()
    assert "| not reached | not reached | not reached |" in md
    printed = capsys.readouterr().out
    assert "2.00×/never" in printed

    job(tmp_path / "b" / "0", "fp32", line(3.0, 1 / 49, floor=0.99), step_time=0.010)
    job(tmp_path / "b" / "1", "bf16", line(3.0, 1 / 49, floor=1.005), step_time=0.005)
    fp32, short = compare(tmp_path / "b", wandb_log=False, target={"target": 1.0})
    assert fp32.figures["target_status"] == "reached" and fp32.figures["target"] == 1.0
    assert short.figures["loss_gap"] == pytest.approx(0.015 / 0.99)  # within the tolerance
    assert short.verdict == (
        "target not reached: its best smoothed eval loss 1.005 stayed 0.50% short of 1 — "
        "not recommended"
    )


def test_a_mode_faster_per_step_but_slower_to_the_target_says_both_and_loses_to_the_target(
    tmp_path,
):
    """bf16 steps 1.31× as fast as fp32 but needs 1.42× the steps to eval loss 1.8 (its curve
    falls 1.42× slower until it, then both end at 1.0): 0.92× to the target. fp16, 1.14× per
    step and converging like fp32, is recommended: the ranking is by the target."""

    def bent(knee: float) -> Callable[[int], float]:  # 3 → 1.5 linearly by `knee`, then to 1.0
        return lambda s: (
            3 - 1.5 * s / knee if s <= knee else 1.5 - 0.5 * (s - knee) / (STEPS - knee)
        )

    job(tmp_path / "0", "fp32", bent(50), step_time=0.0131)
    job(tmp_path / "1", "bf16", bent(71), step_time=0.0100)
    job(tmp_path / "2", "fp16", bent(50), step_time=0.0115)
    fp32, bf16, fp16 = compare(tmp_path, wandb_log=False, target={"target": 1.8})
    assert fp32.figures["steps_to_target"] == pytest.approx(40.0)
    assert bf16.figures["steps_to_target"] == pytest.approx(56.8)
    assert bf16.figures["steps_to_target_ratio"] == pytest.approx(1.42)
    assert bf16.figures["time_to_target_speedup"] == pytest.approx(1.31 / 1.42)
    assert bf16.verdict == (
        "1.31× the step speed, 0.92× to the target: it needs 1.42× the steps (per-job timing; "
        "one seed), eval loss within 0.00% of fp32 (one seed: untested against seed noise; its "
        "one seed within +2%: a seed beyond it up to 95% of the time is not ruled out at 95%; 29 "
        "such seeds would rule out 10%) — slower to the target"
    )
    assert fp16.verdict.startswith("1.14× faster (per-job timing), 1.14× faster to the target")
    assert fp16.verdict.endswith("— recommended")
    assert fp32.verdict == "baseline"


def test_over_three_seeds_the_interval_of_time_to_target_holds_the_truth(tmp_path):
    """Each seed's curve crosses eval loss 1.8 at a known step: fp32 at 50 on average (truth:
    50 × 0.01 s), bf16 at 60 (× 0.008 s: truth 1.0417× faster to the target). Each row's mean
    time has Student's interval over its 3 seeds, and the paired per-seed ratios hold the true
    speedup and steps ratio."""
    fp32_steps = [47.0, 50.5, 52.5]
    bf16_steps = [58.0, 60.0, 62.0]
    for i, (a, b) in enumerate(zip(fp32_steps, bf16_steps, strict=True)):
        job(tmp_path / str(i), "fp32", line(3.0, 1.2 / a, floor=1.2), step_time=0.010, seed=i)
        job(tmp_path / str(3 + i), "bf16", line(3.0, 1.2 / b, floor=1.2), 0.008, seed=i)
    fp32, bf16 = compare(tmp_path, wandb_log=False, target={"target": 1.8})
    for g, steps, step_time in ((fp32, fp32_steps, 0.010), (bf16, bf16_steps, 0.008)):
        f, times = g.figures, np.array(steps) * step_time
        assert f["target_seeds_reached"] == 3 and f["seeds"] == 3
        assert f["steps_to_target"] == pytest.approx(np.mean(steps))
        half = t_quantile(0.975, 2) * times.std(ddof=1) / math.sqrt(3)  # 4.30, not 1.96
        assert f["time_to_target_s_ci_high"] - f["time_to_target_s"] == pytest.approx(half)
        assert (
            f["time_to_target_s_ci_low"]
            < np.mean(steps) * step_time
            < f["time_to_target_s_ci_high"]
        )
    assert (
        fp32.figures["time_to_target_s_ci_low"]
        < 50 * 0.010
        < fp32.figures["time_to_target_s_ci_high"]
    )
    assert (
        bf16.figures["time_to_target_s_ci_low"]
        < 60 * 0.008
        < bf16.figures["time_to_target_s_ci_high"]
    )
    f = bf16.figures
    assert (
        f["time_to_target_speedup_ci_low"]
        < (50 * 0.010) / (60 * 0.008)
        < f["time_to_target_speedup_ci_high"]
    )
    assert f["steps_to_target_ratio_ci_low"] < 1.2 < f["steps_to_target_ratio_ci_high"]
    ratios = [b / a for a, b in zip(fp32_steps, bf16_steps, strict=True)]
    assert f["steps_to_target_ratio"] == pytest.approx(math.exp(np.mean(np.log(ratios))))
    assert "95% CI" in bf16.verdict and "3 seeds" in bf16.verdict


def test_evaluations_too_sparse_to_time_the_target_are_said_so_with_the_interval_to_set(tmp_path):
    """Every 25 steps: 3 evaluations before fp32 reaches its target at step 99; the verdict asks
    for a denser trainer.val_check_interval instead of timing it, and recommends nothing."""
    curve = line(3.0, 1 / 50)
    job(tmp_path / "0", "fp32", curve, step_time=0.010, every=25)
    job(tmp_path / "1", "bf16", curve, step_time=0.005, every=25)
    fp32, bf16 = compare(tmp_path, wandb_log=False)
    assert (
        fp32.figures["target_status"] == "too sparse" and fp32.figures["evals_before_target"] == 3
    )
    assert bf16.verdict.endswith(
        "— time to target untested: evaluations too sparse to time it (3 before the target in "
        "fp32, seed 0; at least 4 needed): set trainer.val_check_interval=12 or less"
    )
    assert "recommended" not in bf16.verdict
    assert fp32.verdict == "baseline — recommended: no mode is shown to be faster here"
    assert "| untested | untested |" in (tmp_path / "compare.md").read_text()


def test_a_metric_where_higher_is_better_is_timed_upwards(tmp_path):
    """compare.target_metric=eval_accuracy compare.target=0.9: accuracy climbs 0.01 a step in
    fp32 (0.9 at step 90), 0.0125 in bf16 (at step 72); its direction from its name."""
    for i, (precision, slope) in enumerate((("fp32", 0.01), ("bf16", 0.0125))):
        job(
            tmp_path / str(i),
            precision,
            lambda s, k=slope: min(1.0, k * s),
            0.01,
            metric="eval_accuracy",
        )
    spec = {"target": 0.9, "target_metric": "eval_accuracy"}
    fp32, bf16 = compare(tmp_path, wandb_log=False, target=spec)
    assert fp32.figures["target_direction"] == "higher"
    assert fp32.figures["steps_to_target"] == pytest.approx(90.0)
    assert bf16.figures["steps_to_target"] == pytest.approx(72.0)
    assert bf16.figures["time_to_target_speedup"] == pytest.approx(1.25)
    assert target.TargetSpec(metric="eval_perplexity").lower
    assert not target.TargetSpec(metric="eval_loss", direction="higher").lower


def test_the_target_comes_from_the_config_or_the_command_line(tmp_path):
    """The sweep's compare.target (its jobs' configs), overridden by `python -m runner.compare
    --target`; a bad direction is refused when the config is composed."""
    curve = line(3.0, 1 / 50)
    job(tmp_path / "0", "fp32", curve, 0.010, config={"compare": {"target": 1.8}})
    job(tmp_path / "1", "bf16", curve, 0.008, config={"compare": {"target": 1.8}})
    fp32, _ = compare(tmp_path, wandb_log=False)
    assert fp32.figures["target"] == 1.8 and fp32.figures["steps_to_target"] == pytest.approx(60.0)
    proc = subprocess.run(
        [sys.executable, "-m", "runner.compare", str(tmp_path), "--no-wandb", "--target", "1.5"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert rows_of(tmp_path)["fp32"]["steps_to_target"] == pytest.approx(75.0)
    assert "eval loss ≤ 1.5000 (compare.target=1.5)" in proc.stdout

    from runner.config.validation import validate
    from runner.errors import UserError
    from tests.helpers import TINY_MLP, make_cfg

    cfg = make_cfg(*TINY_MLP, "compare.target=0.9", "compare.target_metric=eval_accuracy")
    assert cfg.compare.target == 0.9
    with pytest.raises(UserError, match="compare.target_direction"):
        validate(make_cfg(*TINY_MLP, "compare.target_direction=up"))
    check = make_cfg("experiment=amp_check")  # evaluates often enough to time a target
    assert check.trainer.max_steps / check.trainer.val_check_interval >= 2 * crossing.MIN_EVALS


def test_the_dashboard_draws_eval_loss_against_time_and_tokens_and_the_time_to_target(tmp_path):
    import matplotlib.pyplot as plt

    curve = line(3.0, 1 / 50)
    job(tmp_path / "0", "fp32", curve, step_time=0.010)
    job(tmp_path / "1", "bf16", line(3.0, 0.001), step_time=0.005)  # stalls
    groups = compare(tmp_path, wandb_log=False)
    plt.switch_backend("Agg")
    fig, axes = plt.subplots(1, 3)
    dashboard.eval_against(axes[0], groups, "time")
    fp32_line = axes[0].lines[0]
    assert fp32_line.get_xdata()[-1] == pytest.approx(STEPS * 0.010)  # steps × its step time
    assert axes[0].lines[1].get_xdata()[0] == pytest.approx(0.99)  # where it reaches the target
    assert any(list(ln.get_ydata()) == [1.02, 1.02] for ln in axes[0].lines)  # the target
    dashboard.eval_against(axes[1], groups, "tokens")
    assert axes[1].lines[0].get_xdata()[-1] == pytest.approx(STEPS * BATCH * 16)
    dashboard.time_to_target(axes[2], groups)
    heights = [p.get_height() for p in axes[2].patches]
    assert heights == [pytest.approx(0.99), 0.0]
    assert [t.get_text() for t in axes[2].texts] == ["1.00×", "not reached"]
    plt.close(fig)
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(tmp_path / "compare.png").shape
    assert width >= 2400 and height >= 800  # the 2×4 dashboard


def test_wandb_logs_eval_metrics_against_wall_time_and_tokens(tmp_path):
    """Each eval metric again as by_time/<name> and by_tokens/<name>, whose step metrics
    (define_metric) are the run's own clock and the tokens seen."""
    from runner import wandb_file
    from runner.tracking import RunLog, WandbTracker
    from tests.helpers import TINY_MLP, make_cfg

    cfg = make_cfg(*TINY_MLP, "logger=wandb", "logger.mode=offline")
    tracker = WandbTracker(cfg, tmp_path)
    log = RunLog(tmp_path, tracker)
    rows = [
        {"step": s, "loss": 1.0, "step_time_s": 0.5, "samples_per_s": 8.0, "tokens_per_s": 64.0}
        for s in (1, 2)
    ]
    log.log_rows(rows)
    log.amend_last(rows[-1] | {"eval_loss": 0.7}, {"eval_loss": 0.7})
    log.finish({"status": "completed"})
    path = next(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    for _ in range(100):  # W&B's service may still be writing the file as finish() returns
        records = wandb_file.records(path)
        if any(r.HasField("history") for r in records):
            break
        time.sleep(0.1)
    metrics = {r.metric.name: r.metric for r in records if r.HasField("metric") and r.metric.name}
    assert metrics["by_time/eval_loss"].step_metric == "train_time_s"
    assert metrics["by_tokens/eval_loss"].step_metric == "tokens_seen"
    history = wandb_file.history(path)
    evaluated = next(h for h in history if "by_time/eval_loss" in h)
    assert evaluated["train_time_s"] == 1.0 and evaluated["tokens_seen"] == 64.0
    assert evaluated["by_tokens/eval_loss"] == 0.7 and evaluated["step"] == 2
