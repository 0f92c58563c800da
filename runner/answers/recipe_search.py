"""The recipe a model needs in a converting mode (`python -m runner.recipe`): the smallest set of
module × direction units kept in bf16 with which short runs train within the loss tolerance of
bf16, written as a recipe file (`precision.recipe=`), or the word that no small set exists.

1. A run in the mode as configured (candidate 0, every unit in the format) measures each matmul's
   error on its audited step (summary.json's `matmul_error`). The units (a Linear's forward,
   input_grad or weight_grad; mxfp8's forward and input_grad are one: its machinery computes them
   in one format) that computed in the format are ranked lowest SQNR first, the larger share of
   an operand flushed to zero first where two tie.
2. A bf16 run of the same config, seed and steps (once): the reference.
3. Candidate k keeps the k worst units in bf16 (a recipe rule per module); k = 0, 1, 2, ... up to
   `runner.recipe_max`, each a real run of `runner.recipe_steps` steps (the fp32 islands search's
   trial machinery, runner/answers/island_search.py), until one passes: its mean loss over its
   last quarter of steps within `compare.tolerance` (relative) of bf16's over the same steps.

The first that passes is written as recipe.yaml, its figures as comments; every candidate's in
recipe_search.json beside it: the loss gap, the share of the step's FLOPs that ran in the format
(summary's converted FLOPs), and the projected speed on `runner.project`'s GPUs (default H100, B200)
from each run's audited step (runner/measure/projection.py). No candidate passing: no recipe.yaml.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml
from omegaconf import DictConfig

from runner.answers.island_search import Search, percent
from runner.errors import UserError
from runner.files import write_text
from runner.measure import projection
from runner.measure.gpus import gpu_names
from runner.measure.memory import trainer_memory
from runner.precision import mode_of
from runner.precision.recipe import DIRECTIONS
from runner.tracking import dumps

MODES = ("fp8", "mxfp8", "nvfp4", "mxfp4")
RECIPE_FILE, RESULT_FILE = "recipe.yaml", "recipe_search.json"
DEFAULT_GPUS = ["H100", "B200"]
TAIL = 0.25  # the share of the last steps whose mean loss is compared


def check(cfg: DictConfig) -> str:
    """The mode the search converts in; a config it cannot search is one line."""
    mode = cfg.precision.mode
    if mode not in MODES or cfg.precision.stages:
        staged = " with precision.stages" if cfg.precision.stages else ""
        raise UserError(
            f"python -m runner.recipe searches one converting mode: precision={mode}{staged} is "
            f"invalid: allowed: {', '.join(MODES)}, without stages"
        )
    if cfg.precision.recipe:
        raise UserError(
            f"precision.recipe={cfg.precision.recipe!r} is invalid here: the search writes the "
            "recipe (drop precision.recipe; the shorthands such as precision.fp4.skip stay)"
        )
    return mode_of(mode).compute


def _flushed(record: dict) -> float:
    return max((o["underflow"] for o in record["operands"].values()), default=0.0)


def rank(records: list[dict], compute: str) -> list[dict]:
    """The units that computed in `compute`, worst first: lowest SQNR, then largest flushed share.
    Under mxfp8 forward and input_grad are one unit (named forward+input_grad), at its worse."""
    units: dict[tuple[str, str], dict] = {}
    for r in records:
        if r["format"] != compute:
            continue
        direction = r["direction"]
        if compute == "mxfp8" and direction in DIRECTIONS[:2]:
            direction = "forward+input_grad"
        sqnr = (
            r["sqnr_db"] if isinstance(r["sqnr_db"], int | float) else math.inf
        )  # None: no signal
        sqnr = -math.inf if math.isnan(sqnr) else sqnr  # a non-finite product: worst
        unit = {"module": r["module"], "direction": direction, "sqnr_db": sqnr}
        unit["underflow"] = _flushed(r)
        held = units.get((r["module"], direction))
        if held is None or (sqnr, -unit["underflow"]) < (held["sqnr_db"], -held["underflow"]):
            units[(r["module"], direction)] = unit
    return sorted(units.values(), key=lambda u: (u["sqnr_db"], -u["underflow"]))


def rules(units: list[dict]) -> list[dict]:
    """The recipe's rules keeping `units` in bf16: one per module, in the ranking's order."""
    out: dict[str, dict] = {}
    for u in units:
        rule = out.setdefault(u["module"], {"module": u["module"]})
        rule |= dict.fromkeys(u["direction"].split("+"), "bf16")
    return list(out.values())


def tail_loss(rows: list[dict]) -> float:
    """The mean loss over the last TAIL of `rows`' steps (at least one)."""
    last = rows[-max(1, round(len(rows) * TAIL)) :]
    return sum(r["loss"] for r in last) / len(last) if last else math.nan


class RecipeSearch:
    """One config's search: the island search's trials (data and initial weights built once)."""

    def __init__(self, cfg: DictConfig, out: Path):
        self.compute = check(cfg)
        self.cfg, self.out = cfg, out
        self.trials = Search(cfg, out, steps=cfg.runner.recipe_steps)
        self.tolerance = float(cfg.compare.tolerance)
        self.gpus = gpu_names(cfg.runner.project or DEFAULT_GPUS)
        self.entries: dict[str, dict] = {}  # the projection's runs, by candidate

    def run(self, name: str, **mode) -> tuple[dict, object]:
        """A short run (`mode`: precision keys), its projection entry kept under `name`."""
        summary, trainer = self.trials.fit([], **mode)
        summary["folder"] = self.trials.trials[-1]["folder"]
        memory = {"memory": trainer_memory(trainer)}
        rows = trainer.meter.rows
        self.entries[name] = projection.run_entry(
            summary | memory,
            trainer.meter.audited_steps[-1],
            self.cfg.dataset.get("batch_size"),
            rows[-1] if rows else None,
        )
        return summary, trainer

    def candidate(self, k: int, units: list[dict], reference: float) -> dict:
        """Candidate k: the run with `units` kept in bf16 (its recipe file beside it), judged."""
        recipe = self.out / f"candidate-{k}.yaml"
        self.out.mkdir(parents=True, exist_ok=True)
        write_text(recipe, yaml.safe_dump({"rules": rules(units)}, sort_keys=False))
        summary, trainer = self.run(f"candidate {k}", recipe=str(recipe.resolve()))
        return self.judge(k, units, summary, trainer, reference)

    def judge(self, k: int, units: list[dict], summary: dict, trainer, reference: float) -> dict:
        loss = tail_loss(trainer.meter.rows)
        stopped = "stopped" in summary or summary["steps"] < self.trials.steps
        gap = (loss - reference) / abs(reference) if reference else math.nan
        flops = summary.get("flops_per_step")
        return {
            "k": k,
            "kept_bf16": [f"{u['module']} {u['direction']}" for u in units],
            "folder": summary["folder"],
            "final_loss": summary["final_loss"],
            "tail_loss": loss,
            "loss_gap": gap,
            "passes": not stopped and math.isfinite(gap) and gap <= self.tolerance,
            "converted_flop_share": (summary.get("converted_flops_per_step") or 0) / flops
            if flops
            else None,
        }


def search(cfg: DictConfig, out: Path) -> dict:
    """The recipe for `cfg`: the runs in `out/trial-N/` (their recipes `out/candidate-k.yaml`),
    the result returned and written to `out/recipe_search.json`; `out/recipe.yaml` where a
    candidate passed."""
    s = RecipeSearch(cfg, out)
    (out / RECIPE_FILE).unlink(missing_ok=True)  # never a recipe these runs did not pass
    # the mode as configured, each matmul's error measured: it ranks the units
    summary, trainer = s.run("candidate 0", matmul_error=True)
    ranked = rank(trainer.errors.records, s.compute)
    _, bf16 = s.run("bf16", mode="bf16", stages=[])
    reference = tail_loss(bf16.meter.rows)
    candidates = [s.judge(0, [], summary, trainer, reference)]
    cap = min(cfg.runner.recipe_max, len(ranked))
    while not candidates[-1]["passes"] and len(candidates) <= cap:
        k = len(candidates)
        candidates.append(s.candidate(k, ranked[:k], reference))
    projected = projection.project(s.entries, s.gpus)
    for c in candidates:
        c["projected"] = {
            gpu: {
                key: rows[f"candidate {c['k']}"][key] for key in ("step_time_s", "speedup_vs_bf16")
            }
            for gpu, rows in projected.items()
        }
    found = candidates[-1] if candidates[-1]["passes"] else None
    result = {
        "precision": cfg.precision.mode,
        "steps": s.trials.steps,
        "tolerance": s.tolerance,
        "bf16_tail_loss": reference,
        "ranked": ranked,
        "candidates": candidates,
        "found": found is not None,
        "gpus": s.gpus,
    }
    if found:
        recipe = out / RECIPE_FILE
        write_text(
            recipe,
            _header(result, found)
            + yaml.safe_dump({"rules": rules(ranked[: found["k"]])}, sort_keys=False),
        )
        result["recipe"] = str(recipe)
        kept = ", ".join(found["kept_bf16"]) or "nothing"
        result["verdict"] = (
            f"{cfg.precision.mode} trains within {_tolerance(s.tolerance)} of bf16 keeping {kept} in bf16 "
            f"({percent(found['converted_flop_share'])} of the FLOPs in {cfg.precision.mode}; loss gap "
            f"{found['loss_gap']:+.2%}): precision.recipe={recipe}"
        )
    else:
        result["verdict"] = (
            f"no small set: {cfg.precision.mode} stays more than {_tolerance(s.tolerance)} from bf16's loss "
            f"with up to {len(candidates) - 1} unit(s) kept in bf16 (runner.recipe_max="
            f"{cfg.runner.recipe_max}, {len(ranked)} ranked)"
        )
    write_text(out / RESULT_FILE, dumps(result, indent=2) + "\n")
    return result


def _tolerance(tolerance: float) -> str:
    return f"{100 * tolerance:g}%"  # 2%, 0.5%


def _header(result: dict, found: dict) -> str:
    """recipe.yaml's comments: how it was found, each candidate's gap, share and speed."""
    lines = [
        f"# precision={result['precision']}: found by python -m runner.recipe, {result['steps']} "
        f"steps a run, tolerance {_tolerance(result['tolerance'])} of bf16's mean loss over the last "
        f"{TAIL:.0%} of the steps; apply with the same overrides and precision.recipe=THIS_FILE",
    ]
    for c in result["candidates"]:
        speed = ", ".join(f"{gpu} {_x(p['speedup_vs_bf16'])}" for gpu, p in c["projected"].items())
        lines.append(
            f"# candidate {c['k']} ({'passes' if c['passes'] else 'fails'}): kept in bf16: "
            f"{', '.join(c['kept_bf16']) or 'nothing'}; loss gap {c['loss_gap']:+.2%}; "
            f"{percent(c['converted_flop_share'])} of FLOPs in {result['precision']}; "
            f"projected vs bf16 (estimate): {speed}"
        )
    return "\n".join(lines) + "\n"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"
