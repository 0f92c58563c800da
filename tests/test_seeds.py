"""`runner.seeds=N`: a multirun repeats each job with N seeds, and the comparison groups them."""

from __future__ import annotations

import json
import re

import pytest
from omegaconf import OmegaConf

from runner.config.commandline import with_seeds
from runner.config.preflight import preflight
from runner.errors import UserError
from tests.helpers import TINY_MLP, cli


@pytest.mark.parametrize(
    "args, expanded",
    [
        (["-m", "runner.seeds=3", "precision=fp32,bf16"], ["seed=0,1,2"]),
        (["-m", "seed=5", "runner.seeds=2"], ["seed=5,6"]),  # counted from the seed given
        (["experiment=amp_check", "runner.seeds=2"], ["seed=0,1"]),  # a sweep without -m
        (["-m", "runner.seeds=1", "precision=fp32,bf16"], []),
        (["-m", "precision=fp32,bf16"], []),
    ],
)
def test_runner_seeds_becomes_a_seed_sweep(args, expanded):
    kept = [a for a in args if not a.startswith("seed=")]
    assert with_seeds(args) == kept + expanded


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["runner.seeds=3", "model=mlp"],
            "runner.seeds=3 repeats the jobs of a sweep: add -m (python -m runner -m "
            "runner.seeds=3 ...), or set seed=... for one run",
        ),
        (
            ["-m", "runner.seeds=3", "seed=0,1"],
            "runner.seeds=3 and seed=0,1 both choose the seeds: give one of them",
        ),
        (["-m", "runner.seeds=2,3"], "runner.seeds=2,3 is invalid: one number, not a sweep"),
    ],
)
def test_runner_seeds_that_cannot_be_a_seed_sweep_are_one_clear_error(args, message):
    with pytest.raises(UserError, match="^" + re.escape(message)):
        with_seeds(args)


def test_runner_seeds_is_validated_and_a_seed_sweep_preflights():
    with pytest.raises(UserError, match=r"^runner.seeds=0 is invalid: must be ≥ 1$"):
        preflight(["runner.seeds=0"])
    preflight(with_seeds(["-m", "runner.seeds=2", *TINY_MLP]))


@pytest.mark.slow
def test_a_seed_sweep_through_the_cli_is_one_row_over_its_seeds(tmp_path):
    single = cli("runner.seeds=2", *TINY_MLP, cwd=tmp_path)
    assert single.returncode == 2 and single.stderr.startswith("error: runner.seeds=2 repeats")
    assert "Traceback" not in single.stderr

    sweep = tmp_path / "sweep"
    proc = cli(
        "-m",
        "runner.seeds=2",
        *TINY_MLP,
        "trainer.max_steps=5",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    seeds = [OmegaConf.load(sweep / str(i) / ".hydra" / "config.yaml").seed for i in range(2)]
    assert seeds == [0, 1]
    [row] = json.loads((sweep / "compare.json").read_text())
    assert row["jobs"] == ["0", "1"] and row["seeds"] == 2 and row["label"] == "fp32"
    assert row["divergence_rate"] == 0 and row["eval_loss_std"] > 0  # the seeds differ
    assert row["verdict"] == "baseline — recommended: no mode is faster here"
    assert "samples_per_s_iqr" in json.loads((sweep / "0" / "summary.json").read_text())
