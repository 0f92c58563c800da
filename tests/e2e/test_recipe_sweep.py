"""Recipes in the comparison (issue 40 item 4), through the real CLI: an fp32 and a bf16 row,
then nvfp4 under two recipe files in the same sweep folder (a second `-m` whose job folders
have their own names), compared as rows of one setting: each nvfp4 row named by its recipe's
file, with its own share of FLOPs in FP4, its gap to bf16 and its time to target."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests.helpers import cli

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
# the tests' own model and data (tests.test_own_model), importable from the job's folder
ENV = os.environ | {
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    "OMP_NUM_THREADS": "1",
}
GPT = [
    "model=module",
    "model.net._target_=tests.test_own_model.TinyGPT",
    "+model.net.width=16",
    "+model.net.layers=3",
    "dataset.train._target_=tests.test_own_model.token_pairs",
    "dataset.validation._target_=tests.test_own_model.token_pairs",
    "+dataset.validation.seed=1",
    "dataset.batch_size=16",
    "model.loss=output",
    "trainer.max_steps=14",
    "trainer.val_check_interval=2",
    "compare.target=3.55",  # crossed after step 10 (5 evaluations before it: timed)
    "trainer.benchmark.warmup_steps=2",  # each job's own speed: the steps after the second
    "trainer.progress_bar=false",
    "logger=none",
]
RECIPES = {
    # one weight gradient kept high: nearly every FLOP still in FP4
    "one_wgrad.yaml": "- {module: net.blocks.0.proj, weight_grad: bf16}\n",
    # a whole block kept high: a smaller FP4 share
    "block1.yaml": "- {module: 'net.blocks.1.*', forward: bf16, input_grad: bf16, "
    "weight_grad: bf16}\n",
}


def test_recipes_are_rows_named_by_file_with_share_gap_and_time(tmp_path):
    sweep = tmp_path / "sweep"
    files = []
    for name, text in RECIPES.items():
        (tmp_path / name).write_text(text)
        files.append(str(tmp_path / name))
    base = cli("-m", "precision=fp32,bf16", *GPT, f"hydra.sweep.dir={sweep}", cwd=tmp_path, env=ENV)
    assert base.returncode == 0, base.stderr[-3000:]
    ruled = cli(
        "-m",
        "precision=nvfp4",
        f"precision.recipe={','.join(files)}",
        *GPT,
        f"hydra.sweep.dir={sweep}",
        "hydra.sweep.subdir=recipe${hydra.job.num}",
        cwd=tmp_path,
        env=ENV,
    )
    assert ruled.returncode == 0, ruled.stderr[-3000:]
    for folder, mode in (("0", "fp32"), ("1", "bf16")):  # the first command's jobs kept
        assert json.loads((sweep / folder / "summary.json").read_text())["precision"] == mode
    rows = {r["label"]: r for r in json.loads((sweep / "compare.json").read_text())}
    recipes = [f"nvfp4 recipe={name}" for name in RECIPES]
    assert set(rows) == {"fp32", "bf16", *recipes}, list(rows)
    md = (sweep / "compare.md").read_text()
    for column in ("fp8/fp4 FLOPs", "gap to bf16", "time to target"):
        assert column in md, md
    shares = {}
    for label in recipes:
        row = rows[label]
        assert row["plan_held"] is True, row
        shares[label] = row["converted_flop_share"]
        assert 0 < shares[label] < row["low_precision_flop_share"] <= 1, row
        assert math.isfinite(row["loss_gap_bf16"]), row  # against the bf16 row
        assert row["target_status"] == "reached" and row["time_to_target_s"] > 0, row
    wgrad, block = (shares[label] for label in recipes)
    assert block < wgrad, shares  # the block's FLOPs left FP4; one weight gradient's fewer
    gaps = [rows[label]["loss_gap_bf16"] for label in recipes]
    assert gaps[0] != gaps[1], gaps
    for folder, name in (("recipe0", "one_wgrad.yaml"), ("recipe1", "block1.yaml")):
        summary = json.loads((sweep / folder / "summary.json").read_text())
        assert any(
            r.endswith(f"(rule 1 of {tmp_path / name})")
            for r in summary["converted"]["recipe_in_force"]
        )
