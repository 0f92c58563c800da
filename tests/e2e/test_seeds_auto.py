"""`runner.seeds=auto` through the real command line: 3 seeds, then one more at a time for the
rows still undecided, up to runner.max_seeds, and the comparison says what each row took."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from omegaconf import OmegaConf

from tests.helpers import TINY_MLP, cli

pytestmark = pytest.mark.slow
# The sweep every test here runs (with -m), tests/cluster/test_seeds_auto.py too: bf16_true is
# decided worse at 3 seeds, bf16 runs to the cap (4) with fp32 beside it. The tolerance, 0.004%:
# bf16's seeds lie within ±0.0025% of fp32's, its 99.38% interval (2 looks × 2 rows × 2
# intervals) reaches ±0.007% at 3 seeds and ±0.005% at 4.
AUTO = [
    "precision=fp32,bf16_true,bf16",
    *TINY_MLP,
    "runner.seeds=auto",
    "runner.max_seeds=4",
    "compare.tolerance=4e-5",
    "trainer.max_steps=20",
    "trainer.val_check_interval=5",
]


def test_seeds_auto_adds_seeds_to_the_undecided_rows_and_says_why_each_stopped(tmp_path, cpu_kind):
    """bf16_true keeps its weights in bf16: about 0.2% above fp32 in every seed, beyond
    compare.tolerance=4e-5 at once: worse in a seed, decided at 3 seeds. bf16 (autocast) rounds
    only its matmuls' inputs: differences of either sign, every seed's inside 4e-5 but its
    interval not, so it stays open and runs to the cap (4), with fp32 beside it. Under every
    CPU kind: bf16's matmuls then run natively or in fp32 (precision.cpu_kernels)."""
    sweep = tmp_path / "sweep"
    proc = cli(
        "-m",
        *AUTO,
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["label"]: r for r in json.loads((sweep / "compare.json").read_text())}
    assert {k: r["seeds"] for k, r in rows.items()} == {"fp32": 4, "bf16_true": 3, "bf16": 4}
    assert rows["bf16_true"]["seeds_stopped"] == "decided"
    assert rows["bf16_true"]["verdict"].startswith("worse than fp32")
    assert rows["bf16"]["seeds_stopped"] == (
        "the cap, runner.max_seeds=4: its loss gap interval still open"
    )
    assert rows["fp32"]["seeds_stopped"] == "the baseline"
    # 2 looks (3 and 4 seeds) × 2 rows × 2 intervals
    assert rows["bf16"]["confidence"] == pytest.approx(1 - 0.05 / 8)
    assert (
        "99.38% CI" in rows["bf16"]["verdict"] and "paired over 4 seeds" in rows["bf16"]["verdict"]
    )
    # The second round ran seed 3 of fp32 and bf16 only, in folders of its own.
    added = sorted(p.name for p in sweep.glob("seed3-*"))
    assert added == ["seed3-0", "seed3-1"]
    ran = {OmegaConf.load(sweep / a / ".hydra" / "config.yaml").precision.mode for a in added}
    assert ran == {"fp32", "bf16"}
    md = (sweep / "compare.md").read_text()
    assert "| 4: the cap, runner.max_seeds=4: its loss gap interval still open |" in md
    assert "| 3: decided |" in md and "loss gap [99.38% CI]" in md
    assert "bf16 (4 seeds, the cap, runner.max_seeds=4" in proc.stdout
    assert "seeds=auto: bf16 (3 seeds): undecided: its loss gap interval still open" in proc.stderr


def test_seeds_auto_run_again_completes_a_later_round_that_was_cut_short(tmp_path):
    """The second round's bf16 job killed mid-run (its summary never written, its metrics cut
    at step 8, no checkpoint): the sweep reports it; the same command runs that round again,
    its fp32 job read back and the bf16 one run, and ends as the uninterrupted sweep did, loss
    for loss. Once: a round this process ran already is not run again (a job that fails each
    time does not loop)."""
    sweep = tmp_path / "sweep"
    first = cli("-m", *AUTO, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    cut = sweep / "seed3-1"
    whole = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "summary.json").unlink()
    (cut / "metrics.jsonl").write_text("\n".join(whole[:8]) + "\n")
    shutil.rmtree(cut / "checkpoints")
    again = cli("-m", *AUTO, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stderr.replace("\n", "")  # the console wraps its lines at 80 columns
    assert f"{sweep / 'seed3-0'}/checkpoints/last.pt is at step 20: the run had finished" in said
    assert f"{cut}/checkpoints/last.pt is at step 20" not in said
    losses = [
        json.loads(line).get("loss") for line in (cut / "metrics.jsonl").read_text().splitlines()
    ]
    assert losses == [json.loads(line).get("loss") for line in whole]  # every step, once
    rows = {r["label"]: r for r in json.loads((sweep / "compare.json").read_text())}
    assert {k: r["seeds"] for k, r in rows.items()} == {"fp32": 4, "bf16_true": 3, "bf16": 4}
    assert {r["status"] for r in rows.values()} == {"completed"}


def test_seeds_auto_and_its_cap_are_checked_before_anything_runs(tmp_path):
    for args, said in (
        (["runner.seeds=many"], "runner.seeds='many' is invalid: a number of seeds, or auto"),
        (["runner.seeds=auto", "runner.max_seeds=2"], "runner.max_seeds=2 is invalid: must be ≥ 3"),
        (
            ["compare.tolerance=2"],
            "compare.tolerance=2.0 is invalid: a share of the baseline's loss",
        ),
    ):
        proc = cli("-m", "precision=fp32,bf16", *TINY_MLP, *args, cwd=tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("error: " + said), proc.stderr


def test_seeds_auto_under_joblib_runs_each_round_through_its_workers(tmp_path):
    """The same sweep through hydra/launcher=joblib (amp-runner's, hydra_plugins/), 2 workers:
    each round a multirun of the joblib launcher in the same sweep folder."""
    sweep = tmp_path / "sweep"
    proc = cli(
        "-m",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        *AUTO,
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Both rounds through joblib's 2 workers: 9 jobs, then 2.
    launched = re.findall(r"Joblib\.Parallel\(n_jobs=2.*?\) is launching (\d+) jobs", proc.stdout)
    assert launched == ["9", "2"], proc.stdout[-3000:]
    rows = {r["label"]: r for r in json.loads((sweep / "compare.json").read_text())}
    assert {k: r["seeds"] for k, r in rows.items()} == {"fp32": 4, "bf16_true": 3, "bf16": 4}
    assert {r["status"] for r in rows.values()} == {"completed"}
    assert rows["bf16_true"]["seeds_stopped"] == "decided"
    assert rows["bf16_true"]["verdict"].startswith("worse than fp32")
    assert rows["bf16"]["seeds_stopped"] == (
        "the cap, runner.max_seeds=4: its loss gap interval still open"
    )
    assert rows["fp32"]["seeds_stopped"] == "the baseline"
    assert_second_round(sweep)
    md = (sweep / "compare.md").read_text()
    assert "| 4: the cap, runner.max_seeds=4: its loss gap interval still open |" in md
    assert "| 3: decided |" in md and "loss gap [99.38% CI]" in md
    assert "seeds=auto: bf16 (3 seeds): undecided: its loss gap interval still open" in proc.stderr


def assert_second_round(sweep) -> list[str]:
    """The first round in folders 0..8; the second in folders of its own, fp32's and bf16's
    seed 3. Returns those folders."""
    assert sorted(p.name for p in sweep.glob("[0-9]*")) == [str(i) for i in range(9)]
    added = sorted(p.name for p in sweep.glob("seed3-*"))
    assert added == ["seed3-0", "seed3-1"], sorted(p.name for p in sweep.iterdir())
    ran = {}
    for folder in added:
        config = OmegaConf.load(sweep / folder / ".hydra" / "config.yaml")
        ran[config.precision.mode] = config.seed
    assert ran == {"fp32": 3, "bf16": 3}
    return added
