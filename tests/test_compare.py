"""The comparison report: figures against fp32, verdicts, failed and diverged jobs, seeds, the
speed spread, bad input."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from runner.compare import compare, dashboard
from runner.compare.stats import t_quantile
from runner.compare.verdicts import in_short
from runner.errors import UserError
from runner.run import run
from runner.train import telemetry
from tests.helpers import TINY_MLP, make_cfg


def run_job(folder: Path, *overrides: str) -> None:
    """One job of a sweep, with the .hydra/ record Hydra writes for it."""
    cfg = make_cfg(*TINY_MLP, "trainer.max_steps=20", *overrides)
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create(list(overrides)), folder / ".hydra" / "overrides.yaml")
    try:
        run(cfg, folder)
    except UserError:
        pass  # a failed job: its summary.json says why


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    run_job(root / "0", "precision=fp32")
    run_job(root / "1", "precision=bf16")
    run_job(root / "2", "precision=fp16", "precision.grad_scaler.init_scale=1e30")  # skips them all
    run_job(
        root / "3", "precision=fp32", "optim.optimizer.lr=1e5", "trainer.gradient_clip_val=null"
    )
    run_job(root / "4", "precision=bf16", "trainer.device=cuda:7")  # fails: no such device
    return root


def test_every_job_gets_a_row_and_an_honest_verdict(sweep):
    jobs = {g.jobs[0].folder.name: g for g in compare(sweep, wandb_log=False)}
    assert jobs["0"].verdict.startswith("baseline")
    assert jobs["0"].figures["speedup"] == pytest.approx(1.0)
    bf16 = jobs["1"]
    assert bf16.figures["max_loss_gap"] < 0.05 and "of fp32" in bf16.verdict
    assert (
        "(one seed: untested against seed noise; its one seed within +2%: a seed beyond it up to 95% of"
        in bf16.verdict
    )
    assert bf16.figures["speedup"] == pytest.approx(
        bf16.jobs[0].summary["samples_per_s"] / jobs["0"].jobs[0].summary["samples_per_s"]
    )
    assert jobs["2"].verdict == "overflowed: 20 of 20 steps skipped — not recommended"
    assert jobs["3"].verdict.startswith("diverged")
    assert jobs["4"].verdict.startswith("failed: trainer.device=cuda:7 but ")
    # one row recommended, counted by each verdict's outcome (`in_short`), not by its words: a
    # loaded machine can time the fp16 row that skips every step faster than fp32, and the
    # baseline's verdict then names it ("... but fp16 ..., not recommended")
    outcomes = [in_short(j.verdict) for j in jobs.values()]
    assert sum(o in ("recommended", "baseline, recommended") for o in outcomes) == 1


def test_a_faster_refused_row_is_named_and_the_baseline_still_recommended(sweep, tmp_path):
    """The timing the test above once met under load (fp16, skipping every step, timed 1.3×
    fp32's): the baseline stays the one recommended row and names the faster refused one."""
    root = tmp_path / "sweep"
    shutil.copytree(sweep, root)
    path, fp32 = root / "2" / "summary.json", json.loads((root / "0" / "summary.json").read_text())
    summary = json.loads(path.read_text())
    path.write_text(json.dumps(summary | {"samples_per_s": fp32["samples_per_s"] * 1.3}))
    jobs = {g.jobs[0].folder.name: g for g in compare(root, wandb_log=False)}
    assert jobs["0"].verdict.startswith("baseline — recommended: no mode is")
    assert jobs["0"].verdict.endswith("init_scale=1e+30, not recommended")
    assert " but fp16 " in jobs["0"].verdict
    assert in_short(jobs["0"].verdict) == "baseline, recommended"
    assert in_short(jobs["2"].verdict) == "overflowed"


def test_report_files_are_written(sweep):
    compare(sweep, wandb_log=False)
    rows = list(csv.reader(open(sweep / "compare.csv")))
    assert rows[0][:3] == ["precision", "samples/s", "speedup"] and len(rows) == 6
    records = json.loads((sweep / "compare.json").read_text())
    assert [r["status"] for r in records] == ["completed"] * 4 + ["failed"]
    assert "| precision |" in (sweep / "compare.md").read_text()
    png = (sweep / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(sweep / "compare.png").shape
    assert width >= 1200 and height >= 800  # the 2×2 dashboard


def test_an_empty_folder_is_one_clear_error_and_other_models_are_other_settings(tmp_path):
    with pytest.raises(UserError, match="no runs in"):
        compare(tmp_path, wandb_log=False)
    proc = subprocess.run(
        [sys.executable, "-m", "runner.compare", str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: compare:")
    assert "Traceback" not in proc.stderr
    run_job(tmp_path / "0", "precision=fp32")
    run_job(tmp_path / "1", "precision=bf16", "model.hidden_size=16")
    fp32, bf16 = compare(tmp_path, wandb_log=False)
    assert (fp32.label, bf16.label) == ("fp32 hidden_size=64", "bf16 hidden_size=16")
    assert fp32.setting != bf16.setting and bf16.base is None
    assert bf16.verdict == "no fp32 run to compare with"


def fake_job(
    folder: Path,
    precision: str,
    seed: int | None = None,
    eval_loss: float = 2.0,
    speed: float = 100.0,
    iqr: float | None = 2.0,
    diverged: bool = False,
    summary: dict | None = None,
    runner: dict | None = None,
    config: dict | None = None,
    train_loss: float | None = None,
) -> None:
    """A finished job as the runner leaves it, without training: its training loss falls to
    `train_loss` (default: `eval_loss`) and its evaluations (every other step) to `eval_loss`,
    one sample a step at `speed`; `summary`: more of its summary.json, `runner`: its config's
    runner block, `config`: more of its config."""
    end = eval_loss if train_loss is None else train_loss
    losses = [end + (20 - step) / 20 for step in range(1, 21)]
    if diverged:
        losses[-5:] = ["nan"] * 5  # as tracking.jsonable writes a non-finite loss
    summary = (
        {"step_time_s": 1 / speed}
        | (summary or {})
        | {
            "status": "completed",
            "precision": precision,
            "final_loss": losses[-1],
            "eval_loss": "nan" if diverged else eval_loss,
            "samples_per_s": speed,
            "samples_per_s_iqr": iqr,
            "steps": 20,
            "skipped_steps": 0,
            "peak_memory_mb": 100.0,
        }
    )
    (folder / ".hydra").mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(summary))
    rows = [
        {"step": i + 1, "loss": loss, "loss_scale": 1.0, "step_time_s": 1 / speed}
        | ({"eval_loss": loss if diverged else eval_loss + (19 - i) / 20} if i % 2 else {})
        for i, loss in enumerate(losses)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config_extra = config
    config = {"precision": {"mode": precision}, "seed": seed or 0, "model": {"_target_": "a.MLP"}}
    config |= {"runner": runner} if runner else {}
    merged = OmegaConf.merge(OmegaConf.create(config), OmegaConf.create(config_extra or {}))
    OmegaConf.save(merged, folder / ".hydra" / "config.yaml")
    overrides = [f"precision={precision}", *([f"seed={seed}"] if seed is not None else [])]
    OmegaConf.save(OmegaConf.create(overrides), folder / ".hydra" / "overrides.yaml")


def seed_sweep(root: Path, fp32: list[float], bf16: list[float], **bf16_job):
    """`-m precision=fp32,bf16 runner.seeds=3`: jobs 0-2 fp32, 3-5 bf16. The groups compared,
    and compare.json's rows by label."""
    for i, loss in enumerate(fp32):
        fake_job(root / str(i), "fp32", seed=i, eval_loss=loss)
    for i, loss in enumerate(bf16):
        fake_job(root / str(len(fp32) + i), "bf16", seed=i, eval_loss=loss, **bf16_job)
    groups = compare(root, wandb_log=False)
    return groups, {r["label"]: r for r in json.loads((root / "compare.json").read_text())}


@pytest.mark.parametrize(
    "fp32, bf16, gap, verdict",
    [
        # bf16 0.01 above fp32 in every seed: the paired differences agree exactly, so the
        # interval is the point +0.5%, inside the ±2% tolerance at both ends.
        (
            [2.00, 2.02, 1.98],
            [2.01, 2.03, 1.99],
            0.5,
            "1.50× faster (per-job timing), 1.48× faster to the target (1.01× the steps; 95% CI "
            "1.48× to 1.49×, 3 seeds paired, assuming normal log ratios), eval loss equivalent to "
            "fp32's within the ±2% tolerance (+0.50%, 95% CI +0.49% to +0.51%, paired over 3 "
            "seeds, assuming normal log ratios; its 3 seeds all within +2% (the worst +0.51%, seed "
            "2): a seed beyond it up to 63% of the time is not ruled out at 95%; 29 such seeds "
            "would rule out 10%) — recommended",
        ),
        (
            [2.00, 2.02, 1.98],
            [2.10, 2.12, 2.08],
            5.0,
            "worse than fp32: eval loss +5.00%, its interval beyond the 2% tolerance (95% CI "
            "+4.88% to +5.12%, paired over 3 seeds, assuming normal log ratios) — not recommended",
        ),
        (
            [2.0] * 3,
            [2.0] * 3,
            0.0,
            "1.50× faster (per-job timing), 1.50× faster to the target (1.00× the steps; 95% CI "
            "1.50× to 1.50×, 3 seeds paired, assuming normal log ratios), eval loss equivalent to "
            "fp32's",
        ),
        # A difference that is real but inside the 2% tolerance is no reason to refuse a mode.
        (
            [2.0] * 3,
            [2.001] * 3,
            500.0,
            "1.50× faster (per-job timing), 1.50× faster to the target (1.00× the steps; 95% CI "
            "1.50× to 1.50×, 3 seeds paired, assuming normal log ratios), eval loss equivalent to "
            "fp32's within the ±2% tolerance (+0.05%, 95% CI +0.05% to +0.05%, paired over 3 "
            "seeds, assuming normal log ratios; its 3 seeds all within +2% (the worst +0.05%, seed "
            "0): a seed beyond it up to 63% of the time is not ruled out at 95%; 29 such seeds "
            "would rule out 10%) — recommended",
        ),
        # The seeds' spread of 0.1 is shared by both precisions and cancels in the paired
        # ratios: about +5% in every seed is worse, though the unpaired means' intervals overlap.
        (
            [2.0, 2.1, 1.9],
            [2.1, 2.2, 2.0],
            1.0,
            "worse than fp32: eval loss +5.01%, its interval beyond the 2% tolerance (95% CI "
            "+4.39% to +5.63%, paired over 3 seeds, assuming normal log ratios) — not recommended",
        ),
        # +5% on average, but the seeds vary (+5%, +2.4%, +7.9%): the interval reaches from below
        # 0 past the tolerance, yet every seed is beyond it, seed 2 most: worse in a seed.
        (
            [2.0, 2.1, 1.9],
            [2.1, 2.15, 2.05],
            0.1 / np.sqrt(0.00625),  # the pooled spread: variances 0.01 and 0.0025
            "worse than fp32 in seed 2: eval loss +7.89% there, beyond the 2% tolerance (all "
            "seeds +5.07%, 95% CI -1.56% to +12.14%, paired over 3 seeds, assuming normal log "
            "ratios) — not recommended",
        ),
    ],
)
def test_three_seeds_give_means_spreads_and_a_verdict_against_seed_noise(
    tmp_path, fp32, bf16, gap, verdict
):
    groups, rows = seed_sweep(tmp_path, fp32, bf16, speed=150.0, iqr=3.0)
    assert list(rows) == ["fp32", "bf16"]  # one row per precision, not per seed
    base, row = rows["fp32"], rows["bf16"]
    assert row["jobs"] == ["3", "4", "5"] and row["job"] == "3" and row["seeds"] == 3
    assert row["eval_loss_mean"] == row["eval_loss"] == pytest.approx(np.mean(bf16))
    assert row["eval_loss_std"] == pytest.approx(np.std(bf16, ddof=1), abs=1e-12)
    assert row["gap_in_spreads"] == pytest.approx(gap, rel=1e-3)
    assert row["divergence_rate"] == 0 and row["gap_metric"] == "eval_loss"
    assert row["samples_per_s_iqr"] == 3.0 and row["speed_source"] == "jobs"
    assert row["speedup"] == pytest.approx(1.5) and row["verdict"].startswith(verdict)
    ratios = np.array(bf16) / np.array(fp32)  # the geometric mean of the per-seed ratios
    assert row["loss_gap"] == pytest.approx(np.exp(np.log(ratios).mean()) - 1)
    assert row["loss_gap_worst_seed"] == pytest.approx(ratios.max() - 1)
    assert row["loss_gap_ci_low"] <= row["loss_gap"] <= row["loss_gap_ci_high"]
    assert base["gap_in_spreads"] == 0 and base["verdict"].startswith("baseline")
    assert {"final_loss", "final_loss_std", "max_loss_gap", "status", "health"} <= set(row)
    table = (tmp_path / "compare.md").read_text()
    assert "| bf16 | 150.0 | 1.50× | 3.0 |" in table and f"{np.mean(fp32):.4f} ± " in table
    steps, mean, low, high = dashboard._curve(groups[1])  # compare.png: the mean and a band
    assert steps == list(range(1, 21)) and mean[-1] == pytest.approx(np.mean(bf16))
    assert (low[-1], high[-1]) == (min(bf16), max(bf16))


def test_a_mode_that_diverged_in_one_seed_of_three_is_not_recommended(tmp_path):
    for seed, loss in enumerate([2.00, 2.02, 1.98]):
        fake_job(tmp_path / str(seed), "fp32", seed=seed, eval_loss=loss)
        fake_job(tmp_path / str(3 + seed), "bf16", seed=seed, speed=300.0, diverged=seed == 2)
    compare(tmp_path, wandb_log=False)
    rows = {r["label"]: r for r in json.loads((tmp_path / "compare.json").read_text())}
    bf16 = rows["bf16"]
    assert bf16["divergence_rate"] == pytest.approx(1 / 3) and bf16["health"] == "diverged"
    assert bf16["verdict"] == (
        "unstable in 1 of 3 seeds (diverged: the loss became inf/NaN, seed 2) — not recommended"
    )
    assert bf16["eval_loss_mean"] == 2.0 and bf16["seeds"] == 3  # the mean of the good seeds
    assert rows["fp32"]["verdict"] == (
        "baseline — recommended: no mode is faster here but bf16, not recommended"
    )


def test_one_seed_works_as_before_and_says_the_gap_is_untested(tmp_path):
    fake_job(tmp_path / "0", "fp32", eval_loss=2.0)
    fake_job(tmp_path / "1", "bf16", eval_loss=2.01, speed=150.0)
    fake_job(tmp_path / "2", "fp16", eval_loss=2.2, speed=150.0)
    groups = compare(tmp_path, wandb_log=False)
    rows = {r["precision"]: r for r in json.loads((tmp_path / "compare.json").read_text())}
    assert [g.jobs for g in groups] == [[g.jobs[0]] for g in groups]
    assert rows["bf16"]["verdict"] == (
        "1.50× faster (per-job timing), 1.48× faster to the target (1.01× the steps; one seed), "
        "eval loss within 0.50% of fp32 (one seed: untested against seed noise; its one seed "
        "within +2%: a seed beyond it up to 95% of the time is not ruled out at 95%; 29 such "
        "seeds would rule out 10%) — recommended"
    )
    assert rows["fp16"]["verdict"] == (
        "eval loss +10.00% vs fp32 (one seed: untested against seed noise) — not recommended"
    )
    assert rows["bf16"]["seeds"] == 1 and rows["bf16"]["divergence_rate"] == 0
    assert rows["bf16"]["gap_in_spreads"] is None and rows["bf16"]["eval_loss_std"] is None
    assert rows["bf16"]["eval_loss"] == rows["bf16"]["eval_loss_mean"] == 2.01
    assert rows["bf16"]["job"] == "1" and rows["bf16"]["label"] == "bf16"


@pytest.mark.parametrize(
    "iqr, tail",
    [
        (
            4.0,
            "1.06× faster (per-job timing) within the speed spread, 1.06× faster to the target "
            "(1.00× the steps; one seed), eval loss within 0.00% of ",
        ),
        (
            1.0,
            "1.06× faster (per-job timing), 1.06× faster to the target (1.00× the steps; one "
            "seed), eval loss within 0.00% of fp32 ",
        ),
        # An unmeasured speed: only the steps to the target are told.
        (
            None,
            "1.06× faster (per-job timing), 1.00× the steps to the target (one seed), eval loss "
            "within 0.00% of fp32 ",
        ),
    ],
)
def test_a_speedup_inside_the_speed_spread_or_without_one_is_never_recommended(tmp_path, iqr, tail):
    fake_job(tmp_path / "0", "fp32", speed=100.0, iqr=iqr)
    fake_job(tmp_path / "1", "bf16", speed=106.0, iqr=iqr)
    fp32, bf16 = compare(tmp_path, wandb_log=False)
    assert bf16.verdict.startswith(tail)
    if iqr is None:  # a spread never measured: untested, never "faster"
        assert bf16.verdict.endswith(
            "— speed untested: its spread was not measured (under two steady timing intervals)"
        )
        assert fp32.verdict == "baseline — recommended: no mode is shown to be faster here"
        return
    inside = 6.0 <= 2 * iqr  # |106 - 100| within the two IQRs added
    assert bf16.verdict.endswith("— no measurable difference" if inside else "— recommended")
    assert fp32.verdict == "baseline" + (" — recommended: no mode is faster here" if inside else "")


def test_one_seed_worse_on_eval_is_not_recommended_and_no_loss_to_compare_is_untested(tmp_path):
    """One seed: the eval loss decides where there is one (here 30% worse, with the training
    loss equal to fp32's); a row without eval and curve is untested, never "within NaN%"."""
    fake_job(tmp_path / "0", "fp32", eval_loss=2.0)
    fake_job(tmp_path / "1", "bf16", eval_loss=2.6, train_loss=2.0, speed=150.0)
    fake_job(tmp_path / "2", "fp16", speed=150.0)
    summary = json.loads((tmp_path / "2" / "summary.json").read_text())
    del summary["eval_loss"]
    (tmp_path / "2" / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "2" / "metrics.jsonl").write_text("")
    fp32, bf16, fp16 = compare(tmp_path, wandb_log=False)
    assert bf16.figures["final_loss_gap"] == pytest.approx(0.0)
    assert bf16.verdict == (
        "eval loss +30.00% vs fp32 (one seed: untested against seed noise) — not recommended"
    )
    assert fp16.verdict == (
        "final training loss (no eval loss in fp16 seed 0) untested: no loss to compare with "
        "fp32's — not recommended"
    )
    assert fp32.verdict == (
        "baseline — recommended: no mode is faster here but bf16, fp16, not recommended"
    )


def test_a_sweep_of_precision_sub_keys_gives_a_row_per_value_with_its_own_seeds(tmp_path):
    """`-m precision=fp32,fp16 precision.grad_scaler.init_scale=1,65536 seed=0,1`: four rows of
    two seeds, each fp16 row against the fp32 row of its init_scale; one mode's own options
    swept without fp32 are compared with the first row, and the report says so."""
    folder = iter(range(100))
    for precision in ("fp32", "fp16"):
        for scale in (1.0, 65536.0):
            for seed in (0, 1):
                fake_job(
                    tmp_path / "a" / str(next(folder)),
                    precision,
                    seed=seed,
                    eval_loss=2.0
                    + 0.01 * seed
                    + (0.5 if precision == "fp16" and scale == 1 else 0),
                    config={"precision": {"grad_scaler": {"init_scale": scale}}},
                )
    groups = compare(tmp_path / "a", wandb_log=False)
    assert [(g.label, g.figures["seeds"]) for g in groups] == [
        ("fp32 init_scale=1.0", 2),
        ("fp32 init_scale=65536.0", 2),
        ("fp16 init_scale=1.0", 2),
        ("fp16 init_scale=65536.0", 2),
    ]
    fp32_1, fp32_big, fp16_1, fp16_big = groups
    assert (fp16_1.base, fp16_big.base) == (fp32_1, fp32_big)
    assert fp32_1.figures["gap_in_spreads"] == 0  # the same runs twice are not seed noise of 0
    assert fp16_1.figures["health"] == "worse" and fp16_big.figures["loss_gap"] == 0
    for i, update in enumerate(("plain", "kahan")):
        fake_job(
            tmp_path / "b" / str(i),
            "bf16_true",
            eval_loss=2.0 + i,
            config={"precision": {"update": update}},
        )
    plain, kahan = compare(tmp_path / "b", wandb_log=False)
    assert (plain.label, kahan.label) == ("bf16_true update=plain", "bf16_true update=kahan")
    assert plain.verdict.startswith("baseline") and kahan.base is plain
    assert kahan.verdict == (
        "eval loss +50.00% vs bf16_true update=plain (one seed: untested against seed noise) — "
        "not recommended"
    )
    note = "no fp32 run in this setting: its rows are compared with bf16_true update=plain"
    assert kahan.figures["note"] == note and note in (tmp_path / "b" / "compare.md").read_text()


def test_each_job_reports_the_spread_of_its_speed_over_the_steady_window(monkeypatch):
    """Meter.speed: median and interquartile range over the steps after the warm-up, each step
    timed by its logging interval; no spread from a single interval."""
    now = [0.0]
    monkeypatch.setattr(telemetry, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    cfg = OmegaConf.create(
        {
            "benchmark": {"warmup_steps": 2},
            "max_steps": 8,
            "log_every_n_steps": 2,
            "limit_val_batches": 0,
            "val_check_interval": 2,
            "checkpoint_every_n_steps": 0,
        }
    )
    meter = telemetry.Meter(cfg, torch.device("cpu"), 1, [], num_tokens=lambda batch: 0)
    meter.start(0)
    zero = torch.tensor(0.0)
    result = SimpleNamespace(grad_norm=zero, loss_scale=zero, skipped=zero)
    step = 0
    for step_time in (1.0, 0.1, 0.2, 0.4):  # the warm-up, then three steady intervals
        for _ in range(2):
            step += 1
            meter.record(step, {"loss": zero}, result, [{"x": torch.zeros(4)}], 0.0, 1e-3, "fp32")
        now[0] += 2 * step_time
        meter.flush(0)
        meter.lap()
        if step == 2:  # only the warm-up: no speed, rather than the warm-up's
            speed = meter.speed()
            assert speed["samples_per_s"] is None and speed["speed_intervals"] == 0
            assert "no steady window" in speed["speed_note"]
        if step == 4:
            assert meter.speed()["samples_per_s_iqr"] is None  # one steady interval
    speed = meter.speed()
    times = [0.1, 0.1, 0.2, 0.2, 0.4, 0.4]
    throughput = [4 / t for t in times]
    assert speed["speed_intervals"] == 3
    assert speed["step_time_s"] == pytest.approx(0.2)
    assert speed["samples_per_s"] == pytest.approx(20)
    iqr = np.percentile(throughput, 75) - np.percentile(throughput, 25)
    assert speed["samples_per_s_iqr"] == pytest.approx(iqr)
    assert speed["step_time_s_iqr"] == pytest.approx(np.subtract(*np.percentile(times, [75, 25])))


def test_the_dashboard_draws_memory_by_category_and_the_loss_gap(tmp_path):
    """summary.json's `memory` stacked by category (as MB or {"mb": ...}) under the measured
    peak, else peak_memory_mb; the loss gap to fp32 in percent, smoothed."""
    import matplotlib.pyplot as plt

    memory = {"params": {"mb": 1.0}, "grads": 1.0, "optimizer": 2.0, "masters": {"mb": 0.0}}
    fake_job(tmp_path / "0", "fp32", summary={"memory": memory | {"activations": 4, "peak": 9}})
    big = {"memory": memory | {"activations": 6, "peak": 9}}
    fake_job(tmp_path / "1", "bf16", eval_loss=2.2, summary=big)
    groups = compare(tmp_path, wandb_log=False)
    plt.switch_backend("Agg")
    fig, axes = plt.subplots(1, 3)
    dashboard._memory(axes[0], groups)
    tops = [p.get_y() + p.get_height() for p in axes[0].patches][-2:]  # the activations on top
    assert tops == [8.0, 10.0] and list(axes[0].lines[0].get_ydata()) == [9.0, 9.0]
    for job in (j for g in groups for j in g.jobs):
        del job.summary["memory"]
    dashboard._memory(axes[1], groups)
    assert [p.get_height() for p in axes[1].patches] == [100.0, 100.0]  # peak_memory_mb
    dashboard._gaps(axes[2], groups)
    # Smoothed over the last two steps (a tenth of 20): bf16 2.225, fp32 2.025.
    assert axes[2].lines[0].get_ydata()[-1] == pytest.approx(100 * 0.2 / 2.025)
    plt.close(fig)


def test_a_small_shift_over_ten_seeds_that_do_not_pair_is_tested_by_welchs_interval(tmp_path):
    """10 seeds a side, bf16's seeds not fp32's (10-19 against 0-9: nothing to pair), 1.9
    spreads (5.7%) above fp32: under 2 spreads, which an effect size alone would pass, but
    Welch's 95% interval for the difference lies past the 2% tolerance."""
    z = np.array([-1.5, -1.2, -0.8, -0.4, -0.1, 0.1, 0.4, 0.8, 1.2, 1.5])
    fp32 = 2.0 + 0.06 * z / z.std(ddof=1)
    bf16 = fp32 + 1.9 * 0.06
    for i, loss in enumerate(fp32):
        fake_job(tmp_path / str(i), "fp32", seed=i, eval_loss=loss)
        fake_job(tmp_path / str(10 + i), "bf16", seed=10 + i, eval_loss=bf16[i], speed=150.0)
    compare(tmp_path, wandb_log=False)
    row = {r["label"]: r for r in json.loads((tmp_path / "compare.json").read_text())}["bf16"]
    assert row["gap_in_spreads"] == pytest.approx(1.9) and row["loss_gap_test"] == "welch"
    ours, theirs = np.log(bf16), np.log(fp32)  # Welch's t on the log losses
    v1, v2 = ours.var(ddof=1) / 10, theirs.var(ddof=1) / 10
    df = (v1 + v2) ** 2 / (v1**2 / 9 + v2**2 / 9)  # Welch–Satterthwaite: about 18
    half = t_quantile(0.975, df) * np.sqrt(v1 + v2)
    low = np.exp(ours.mean() - theirs.mean() - half) - 1
    assert 17.9 < df < 18 and row["loss_gap_ci_low"] == pytest.approx(low, rel=1e-9)
    assert row["verdict"].startswith("worse than fp32: eval loss +5.70%, its interval beyond")
    assert "Welch, 10 and 10 seeds" in row["verdict"]


@pytest.mark.parametrize(
    "df, quantile", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (1000, 1.9623)]
)
def test_the_t_quantile_matches_the_tables(df, quantile):
    from runner.compare.stats import t_quantile

    assert t_quantile(0.975, df) == pytest.approx(quantile, abs=2e-4)


def test_a_row_whose_matmuls_were_emulated_in_fp32_is_never_recommended_on_speed(tmp_path):
    """precision.cpu_kernels=fast: bf16's matmuls ran in fp32, so 1.5× is no bf16 speed."""
    fake_job(tmp_path / "0", "fp32", speed=100.0, iqr=1.0, summary={"cpu_kernels": "native"})
    fake_job(tmp_path / "1", "bf16", speed=150.0, iqr=1.0, summary={"cpu_kernels": "fast"})
    fp32, bf16 = compare(tmp_path, wandb_log=False)
    assert bf16.figures["speed_emulated"] and not fp32.figures["speed_emulated"]
    assert bf16.verdict.endswith(
        "— speed emulated: its bf16 matmuls ran in fp32 on this CPU (precision.cpu_kernels), so "
        "it tells nothing of its own speed"
    )
    assert fp32.verdict == "baseline — recommended: no mode is shown to be faster here"
    assert json.loads((tmp_path / "compare.json").read_text())[1]["speed_emulated"] is True


def test_a_row_whose_precision_plan_did_not_hold_is_never_recommended(tmp_path, capsys):
    """summary.json's plan_held: false keeps a row from any recommendation, its verdict the
    manifest's first mismatch; a job from before the manifest is "untested"."""
    mismatches = ["model.fc1 forward: computed in fp32, planned bf16", "model.fc2 forward: ..."]
    broken = {"plan_held": False, "precision_manifest": {"mismatches": mismatches}}
    fake_job(tmp_path / "0", "fp32", summary={"plan_held": True})
    fake_job(tmp_path / "1", "bf16", speed=200.0, summary=broken)
    fake_job(tmp_path / "2", "fp16", speed=150.0)
    fp32, bf16, fp16 = compare(tmp_path, wandb_log=False)
    assert bf16.verdict == f"the precision plan did not hold: {mismatches[0]}"
    assert fp16.verdict.endswith("— recommended")  # the fastest whose plan was not refuted
    md = (tmp_path / "compare.md").read_text().splitlines()
    header = md[2].split(" | ")
    column = header.index("plan held")
    assert [line.split(" | ")[column] for line in md[4:7]] == ["yes", "no", "untested"]
    # Printed: a table that fits the terminal (80 columns here), the verdicts whole below it.
    printed = capsys.readouterr().out.splitlines()
    table = printed[: printed.index(f"fp32: {fp32.verdict}")]
    assert max(len(line.rstrip()) for line in table) <= 80
    assert any(line.startswith("bf16 ") and "the precision plan did not" in line for line in table)
    for g in (fp32, bf16, fp16):
        assert f"{g.label}: {g.verdict}" in printed


def test_the_speed_whiskers_are_the_quartiles_themselves(tmp_path):
    """compare.png's speed bars: the median, whiskers to the first and third quartiles of the
    steady window's per-step speed (never median ± IQR/2, which goes below zero)."""
    import matplotlib.pyplot as plt

    # The steady window, steps 11-20: median 10, quartiles 10 and 400 (10 ± IQR/2 reaches -185).
    rates = [10.0] * 16 + [400.0] * 4
    iqr = 390.0
    for folder, precision in (("0", "fp32"), ("1", "bf16")):
        fake_job(tmp_path / folder, precision, speed=10.0, iqr=iqr)
        rows = read_rows(tmp_path / folder)
        lines = [
            json.dumps(r | {"samples_per_s": v}) + "\n" for r, v in zip(rows, rates, strict=True)
        ]
        (tmp_path / folder / "metrics.jsonl").write_text("".join(lines))
    groups = compare(tmp_path, wandb_log=False, speed="jobs")
    assert (groups[0].figures["samples_per_s_q1"], groups[0].figures["samples_per_s_q3"]) == (
        10.0,
        400.0,
    )
    plt.switch_backend("Agg")
    fig, ax = plt.subplots()
    dashboard._speed(ax, groups)
    whisker = ax.containers[0].lines[2][0].get_segments()[0]  # the first bar's error bar
    assert [y for _, y in whisker] == [10.0, 400.0]
    plt.close(fig)


def read_rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_an_auto_sweeps_wandb_table_carries_the_paired_interval_and_the_seeds_taken(tmp_path):
    """runner.seeds=auto, looked at for the last time: the `compare` run's W&B table has the
    columns of compare.md, the level of the split intervals in their heads, and each row's
    seeds with why it stopped."""
    auto = {"seeds": "auto", "max_seeds": 6}
    logger = {"logger": {"backend": "wandb", "mode": "offline", "project": "amp-runner-test"}}
    for i, loss in enumerate([2.0, 2.1, 1.9]):
        fake_job(tmp_path / str(i), "fp32", seed=i, eval_loss=loss, runner=auto, config=logger)
        fake_job(
            tmp_path / str(3 + i),
            "bf16",
            seed=i,
            eval_loss=loss * 1.001,
            runner=auto,
            config=logger,
        )
    compare(tmp_path)
    [table_file] = tmp_path.glob("wandb/offline-run-*/files/media/table/comparison_*.table.json")
    table = json.loads(table_file.read_text())
    rows = {r[0]: dict(zip(table["columns"], r, strict=True)) for r in table["data"]}
    assert "loss gap [99.38% CI]" in table["columns"]  # 5% over 4 looks × 1 row × 2 intervals
    assert rows["bf16"]["seeds"] == "3: decided" and rows["fp32"]["seeds"] == "3: the baseline"
    assert rows["bf16"]["loss gap [99.38% CI]"] == "+0.1% [+0.1%, +0.1%]"
    assert "paired over 3 seeds" in rows["bf16"]["verdict"]
