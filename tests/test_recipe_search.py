"""The recipe search (runner/answers/recipe_search.py, `python -m runner.recipe`)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from runner.answers.recipe_rank import rank, rules
from runner.answers.recipe_search import search, tail_loss
from runner.config.validation import validate
from runner.errors import UserError
from runner.run import run
from tests.helpers import error_record, make_cfg, module_run, read_metrics

REPO = Path(__file__).resolve().parents[1]

OUTLIER = 1e3  # an nvfp4 block of 16 holding it flushes its other, O(1), values to zero
CHANNELS = (0, 16)  # one in each block of 16 of the outlier layer's 32 input features


class Outliers(nn.Module):
    """A net of width 32 whose middle Linear (`hot`) takes an input with a huge channel in each
    nvfp4 block, as an LLM's massive activations: its weight on those channels is held at zero,
    so they add nothing to its product, yet in nvfp4 they flush the rest of its input."""

    def __init__(self, width: int = 32, features: int = 8, outputs: int = 3):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.mid = nn.Linear(width, width)
        self.hot = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.tail = nn.Linear(width, width)
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        h = torch.relu(self.mid(torch.relu(self.inp(x))))
        mask = torch.ones(h.shape[-1], dtype=h.dtype, device=h.device)
        spike = torch.zeros_like(mask)
        for c in CHANNELS:
            mask[c], spike[c] = 0.0, OUTLIER
        with torch.no_grad():
            self.hot.weight.mul_(mask.to(self.hot.weight.dtype))
        h = self.norm(self.hot(h * mask + spike))
        return self.head(torch.relu(self.tail(h)))


OUTLIERS = "tests.test_recipe_search.Outliers"
STEPS = 32  # nvfp4 of every Linear ends 5-10% above bf16's loss by then; the recipe within 1%


def outliers(*overrides: str, steps: int = STEPS):
    # one thread, pinned: the search's trials and the training runs compared with them compute
    # alike whatever other processes take of the cores (a run picks its threads by them)
    args = [
        f"trainer.max_steps={steps}",
        f"runner.recipe_steps={steps}",
        "trainer.cpu_threads=1",
        *overrides,
    ]
    return make_cfg(*module_run(OUTLIERS, "precision=nvfp4", *args))


def gap(run_dir: Path, reference: Path) -> float:
    """The relative gap of a run's mean loss over its last quarter of steps to the reference's."""
    loss, ref = (tail_loss(read_metrics(d)) for d in (run_dir, reference))
    return (loss - ref) / ref


@pytest.mark.slow  # a real search: 6 short runs (2 seeds) and 3 trainings
def test_the_search_keeps_the_outlier_layer_and_its_recipe_trains_within_tolerance(tmp_path):
    result = search(outliers(), tmp_path / "search")
    worst = result["ranked"][0]
    assert (worst["module"], worst["direction"]) == ("net.hot", "forward")
    assert worst["underflow"] > 0.8  # the outlier flushes its blocks
    assert result["found"]
    first, *_, found = result["candidates"]
    assert not first["passes"] and first["loss_gap"] > 0.02
    assert found["passes"] and "net.hot forward" in found["kept_bf16"]
    assert all(not c["passes"] for c in result["candidates"][:-1])  # the smallest that passed
    # recipe.yaml is a recipe: applied by precision.recipe= in a training run, its loss is within
    # the tolerance of bf16's where every Linear in nvfp4 is not.
    recipe = tmp_path / "search" / "recipe.yaml"
    assert {"module": "net.hot", "forward": "bf16"} in yaml.safe_load(recipe.read_text())["rules"]
    run(outliers(f"precision.recipe={recipe}"), tmp_path / "recipe")
    run(outliers(), tmp_path / "all")
    run(outliers("precision=bf16"), tmp_path / "bf16")
    assert abs(gap(tmp_path / "recipe", tmp_path / "bf16")) <= 0.02
    assert gap(tmp_path / "all", tmp_path / "bf16") > 0.02
    assert gap(tmp_path / "recipe", tmp_path / "bf16") == pytest.approx(found["loss_gap"], abs=1e-6)
    # Its figures: the FLOPs it keeps in nvfp4 (less than all's), each candidate's projection.
    assert found["converted_flop_share"] < first["converted_flop_share"]
    assert set(found["projected"]) == {"H100 SXM", "B200"}
    assert found["projected"]["B200"]["speedup_vs_bf16"] > 0
    header = recipe.read_text().splitlines()
    assert header[1].startswith("# candidate 0 (fails): kept in bf16: nothing; loss gap +")
    assert "B200 " in header[1] and "of FLOPs in nvfp4" in header[1]
    # Judged on 2 seeds: within the tolerance on both, the noise measured on candidate 0.
    assert len(found["loss_gaps"]) == 2 and max(found["loss_gaps"].values()) <= 0.02
    assert result["noise"]["spread"] > 0
    # As torchao's module filter: net.hot keeps one direction in bf16, so it is kept whole.
    scope: dict = {}
    exec((tmp_path / "search" / "recipe_filter.py").read_text(), scope)  # noqa: S102
    converts = {n: scope["module_filter_fn"](None, n) for n in ("inp", "mid", "hot", "tail")}
    assert converts == {"inp": False, "mid": True, "hot": False, "tail": True}


def test_no_small_set_writes_no_recipe(tmp_path):
    """Within a tolerance no candidate meets, up to runner.recipe_max units: no recipe.yaml."""
    cfg = outliers(
        "compare.tolerance=1e-6", "runner.recipe_max=1", "runner.recipe_seeds=1", steps=8
    )
    (tmp_path / "recipe.yaml").write_text("rules: []\n")  # a stale one goes too
    result = search(cfg, tmp_path)
    assert not result["found"] and len(result["candidates"]) == 2
    assert result["verdict"].startswith("no small set: nvfp4 stays more than 0.0001% from bf16's")
    assert not (tmp_path / "recipe.yaml").exists()
    assert json.loads((tmp_path / "recipe_search.json").read_text())["found"] is False


def _record(module, direction, sqnr, flushed, fmt="mxfp8"):
    return error_record(module, direction, sqnr, fmt=fmt, flushed=flushed)


def test_units_rank_by_sqnr_then_flushed_share_and_mxfp8_keeps_forward_with_input_grad():
    records = [
        _record("a", "forward", 20.0, 0.1),
        _record("a", "input_grad", 12.0, 0.0),
        _record("b", "weight_grad", 12.0, 0.3),
        _record("c", "forward", 5.0, 0.0, fmt="bf16"),  # not in the format: not a unit
        _record("d", "weight_grad", "inf", 0.0),
    ]
    ranked = rank(records, "mxfp8")
    assert [(u["module"], u["direction"], u["sqnr_db"]) for u in ranked] == [
        ("b", "weight_grad", 12.0),
        ("a", "forward+input_grad", 12.0),
        ("d", "weight_grad", math.inf),
    ]
    # mxfp8 keeps forward and input_grad high only with weight_grad: the module unconverted
    assert rules(ranked[:2]) == [
        {"module": "b", "weight_grad": "bf16"},
        {"module": "a", "forward": "bf16", "input_grad": "bf16", "weight_grad": "bf16"},
    ]
    assert [u["direction"] for u in rank(records, "fp8")] == []
    records = [{**r, "format": "nvfp4"} for r in records[:2]]
    assert [u["direction"] for u in rank(records, "nvfp4")] == ["input_grad", "forward"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("precision=fp16", "precision=fp16 is invalid: allowed: fp8, mxfp8, nvfp4, mxfp4, "),
        ("precision=bf16", "precision=bf16 is invalid: allowed"),
        ("precision.recipe=x.yaml", "precision.recipe='x.yaml' is invalid here: the search writes"),
        ("precision.fp32_modules=auto", "precision.fp32_modules=auto is invalid here: name the"),
    ],
)
def test_a_config_it_cannot_search_is_one_line(tmp_path, override, message):
    with pytest.raises(UserError, match=re.escape(message)):
        search(outliers(override), tmp_path)
    assert not list(tmp_path.iterdir())  # before any run


@pytest.mark.parametrize("key", ["recipe_max", "recipe_steps", "recipe_seeds"])
def test_bad_caps_are_one_line(key):
    with pytest.raises(UserError, match=re.escape(f"runner.{key}=0 is invalid: must be ≥ 1")):
        validate(outliers(f"runner.{key}=0"))


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runner.recipe", *args],
        cwd=cwd,
        env=os.environ | {"PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_the_command_prints_the_candidates_and_exits_by_its_verdict(tmp_path):
    args = module_run(OUTLIERS, "precision=nvfp4", f"trainer.max_steps={STEPS}")
    found = _cli(
        *args, f"runner.recipe_steps={STEPS}", f"hydra.run.dir={tmp_path / 'a'}", cwd=tmp_path
    )
    assert found.returncode == 0, found.stderr
    assert "  net.hot forward: SQNR " in found.stdout
    assert "| 0 (trial-0) | nothing | +" in found.stdout
    assert found.stdout.splitlines()[-1].startswith("nvfp4 trains within 2% of bf16 keeping ")
    assert (tmp_path / "a" / "recipe.yaml").is_file()
    none = _cli(
        *args,
        "runner.recipe_steps=8",
        "runner.recipe_max=1",
        "compare.tolerance=1e-6",
        f"hydra.run.dir={tmp_path / 'b'}",
        cwd=tmp_path,
    )
    # 8 steps: candidate 0's gap moves 8.8% between seeds 0 and 1, candidate 1's is within that
    # of the tolerance: the runs cannot tell, and say so
    assert none.returncode == 1 and none.stdout.splitlines()[-1].startswith("cannot tell: ")
    assert not (tmp_path / "b" / "recipe.yaml").exists()
    for bad, words in (
        (["precision=fp32"], "error: the fp32 islands search needs a low-precision mode: "),
        (["-m", "precision=nvfp4,mxfp4"], "error: python -m runner.recipe searches one config"),
    ):
        proc = _cli(*module_run(OUTLIERS, *bad), f"hydra.run.dir={tmp_path / 'c'}", cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.startswith(words), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
