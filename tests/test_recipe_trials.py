"""The recipe search's trials are the user's runs (runner/answers/recipe_search.py): each built as
`python -m runner` builds its model (the user's hooks intact), each writing its precision
manifest and holding its plan, and the rules they run are rules the mode computes."""

from __future__ import annotations

import json

import pytest
import yaml
from torch import nn

from runner.answers import trials
from runner.answers.recipe_rank import ladder, rank
from runner.answers.recipe_search import RecipeSearch, search
from runner.errors import UserError
from runner.precision.recipe import DIRECTIONS
from runner.run import run
from tests.helpers import make_cfg, module_run, read_metrics
from tests.test_fp4 import _gpt

GAIN = 1e6  # the hook's: with optim.optimizer.eps=100 AdamW steps about lr·g/100 without it


class Hooked(nn.Module):
    """A user's net that scales each Linear's weight gradient by GAIN with a hook registered in
    its constructor: at the LR and eps of HOOKED, without the hook its weights barely move. Its
    two middle Linears (32×32) convert in nvfp4."""

    def __init__(self, width: int = 32, features: int = 8, outputs: int = 3, gain: float = GAIN):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.mid = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.head = nn.Linear(width, outputs)
        for p in self.parameters():
            p.register_hook(lambda g: g * gain)

    def forward(self, x):
        return self.head(nn.functional.gelu(self.mid(nn.functional.gelu(self.inp(x)))))


STEPS = 16
HOOKED = [
    "optim.optimizer.lr=1e-1",
    "optim.optimizer.eps=100",
    "trainer.gradient_clip_val=null",
    "optim.scheduler.warmup_steps=0",
    f"trainer.max_steps={STEPS}",
    f"runner.recipe_steps={STEPS}",
    "runner.recipe_seeds=1",
    "compare.tolerance=0.5",  # candidate 0 passes: the search ends there
    "trainer.cpu_threads=1",  # the standalone runs' threads, whatever other processes take
]


def hooked(*overrides: str):
    return make_cfg(*module_run("tests.test_recipe_trials.Hooked", *HOOKED, *overrides))


def losses(folder) -> list[float]:
    return [r["loss"] for r in read_metrics(folder)]


def test_the_search_runs_the_users_model_with_its_hooks_as_a_standalone_run_does(tmp_path):
    """The bf16 reference and candidate 0 of a search equal, loss for loss, a standalone run of
    the same config: the user's gradient hooks hold in the search's runs (a deep copy of the
    model drops them, and its bf16 reference would not learn)."""
    result = search(hooked("precision=nvfp4"), tmp_path / "search")
    bf16 = run(hooked("precision=bf16"), tmp_path / "bf16")
    nvfp4 = run(hooked("precision=nvfp4"), tmp_path / "nvfp4")
    assert bf16["steps"] == nvfp4["steps"] == STEPS
    reference = losses(tmp_path / "bf16")
    assert reference[-1] < 0.8 * reference[0]  # it learns, by the hook
    trials = {t["name"]: t["folder"] for t in result["trials"]}
    assert losses(tmp_path / "search" / trials["bf16"]) == reference
    assert losses(tmp_path / "search" / trials["candidate 0"]) == losses(tmp_path / "nvfp4")


def test_an_mxfp8_searchs_candidates_run_the_rules_mxfp8_computes_and_differ(tmp_path):
    """mxfp8's units are what MXFP8Linear switches: keeping forward+input_grad in bf16 keeps the
    module unconverted (all three directions), weight_grad alone is wgrad_with_hp. Each candidate
    then runs differently from candidate 0, and every trial's manifest holds its plan."""
    cfg = make_cfg(
        *_gpt(
            "precision=mxfp8",
            "precision.fp8.skip=[]",
            "trainer.max_steps=4",
            "runner.recipe_steps=4",
            "runner.recipe_seeds=1",
            width=32,
        )
    )
    s = RecipeSearch(cfg, tmp_path)
    summary, trainer = s.run("candidate 0", matmul_error=True)
    s.reference()
    ranked = rank(trainer.errors.records, "mxfp8")
    assert {u["direction"] for u in ranked} == {"forward+input_grad", "weight_grad"}
    first = s.judge(0, [], summary, trainer, {})
    fused = ranked[0]
    alone = next(
        u for u in ranked if u["direction"] == "weight_grad" and u["module"] != fused["module"]
    )
    # keeping the worst unit keeps its module's weight_grad too: the ladder does not add it again
    assert (fused["module"], "weight_grad") not in [
        (u["module"], u["direction"]) for u in ladder(ranked)
    ]
    for k, kept in enumerate(([fused], [alone], [fused, alone]), start=1):
        c = s.candidate(k, kept)
        assert c["tail_loss"] != first["tail_loss"], k
    rules = yaml.safe_load((tmp_path / "candidate-1.yaml").read_text())["rules"]
    assert rules == [{"module": fused["module"], **dict.fromkeys(DIRECTIONS, "bf16")}]
    assert yaml.safe_load((tmp_path / "candidate-2.yaml").read_text())["rules"] == [
        {"module": alone["module"], "weight_grad": "bf16"}
    ]
    assert len(s.trials.trials) == 5
    for t in s.trials.trials:
        written = json.loads((tmp_path / t["folder"] / "summary.json").read_text())
        assert t["plan_held"] and written["plan_held"], written["precision_manifest"]["mismatches"]
    # candidate 1's manifest: the module kept unconverted computes as bf16 autocast does (on
    # this CPU kind, fp32 from bf16 operands), no direction in mxfp8
    manifest = json.loads((tmp_path / "trial-2" / "summary.json").read_text())
    ops = [
        op
        for stage in manifest["precision_manifest"]["stages"]
        for op in stage["modules"][fused["module"]]["ops"]
    ]
    assert ops and {op["format"] for op in ops} <= {"bf16", "fp32"}


def test_a_trial_whose_plan_did_not_hold_stops_the_search_in_one_line(tmp_path, monkeypatch):
    """Every trial builds its precision manifest and writes it; one whose plan did not hold ends
    the search with the first mismatch named (the command: exit 2), its summary.json kept."""
    real = trials.manifest.build

    def broken(*args, **kwargs):
        held = real(*args, **kwargs)
        mismatch = "the plan converts net.mid.0 to nvfp4; net.mid.0's forward (mm) ran in bf16"
        return held | {"mismatches": [mismatch, "another"], "plan_held": False}

    monkeypatch.setattr(trials.manifest, "build", broken)
    with pytest.raises(UserError) as e:
        search(hooked("precision=nvfp4", "runner.recipe_steps=2"), tmp_path)
    assert str(e.value) == (
        "trial-0 (nvfp4) did not run as planned: the plan converts net.mid.0 to nvfp4; "
        f"net.mid.0's forward (mm) ran in bf16 (and 1 more: {tmp_path / 'trial-0' / 'summary.json'}"
        "'s precision_manifest)"
    )
    written = json.loads((tmp_path / "trial-0" / "summary.json").read_text())
    assert written["plan_held"] is False and not (tmp_path / "recipe.yaml").exists()
