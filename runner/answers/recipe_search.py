"""The recipe a model needs in a converting mode (`python -m runner.recipe`): the smallest set of
module × direction units kept in bf16 with which short runs train within the loss tolerance of
bf16, written as a recipe file (`precision.recipe=`) and in the forms trainers read
(runner/answers/recipe_export.py), or the word that no small set exists, or that its runs cannot
tell.

Every run is a trial (runner/answers/trials.py): the user's run of the same config, its first
`runner.recipe_steps` steps, its precision manifest written and held (a plan that did not hold
stops the search, one line).

1. A run in the mode as configured (candidate 0, every unit in the format) measures each matmul's
   error at its first step and every RANK_STEPS-th of its steps (matmul_error); the units that
   computed in the format are ranked on those measurements (runner/answers/recipe_rank.py: each
   unit's mean SQNR and its spread over the steps; neighbours closer than their spread tied).
2. A bf16 run of the same config on each of `runner.recipe_seeds` seeds (seed, seed+1, ...), and
   candidate 0 on each further one. A candidate's gap on a seed is its mean loss over its last
   TAIL of steps relative to bf16's on that seed (a paired difference: one init, one data
   order); the noise is the spread (max − min) of candidate 0's gaps over the seeds.
3. Candidate k keeps the first k units in bf16 (a recipe rule per module); k = 0, 1, 2, ... up to
   `runner.recipe_max`, each a run, until one passes. A candidate within `compare.tolerance` on
   the config's seed runs on every other seed too: it passes where it is within it on every
   seed, and is within noise where the seeds disagree. One beyond it fails where its gap exceeds
   the tolerance by more than the noise, and is within noise otherwise (another seed might pass).

The first that passes is written as recipe.yaml, its figures as comments, with its exported forms
(runner/answers/recipe_export.py); every candidate's in recipe_search.json beside it: its gaps,
outcome, the earlier candidates whose gaps it is within noise of, the share of the step's FLOPs
that ran in the format (summary's converted FLOPs), and the projected speed on
`runner.project`'s GPUs (default H100, B200) from each run's audited step
(runner/measure/projection.py). No candidate passing: no recipe.yaml, and the verdict says
whether the runs could not tell (runner/answers/recipe_verdict.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml
from omegaconf import DictConfig

from runner.answers import recipe_export
from runner.answers.recipe_rank import ladder, rank, rules
from runner.answers.recipe_verdict import FAILS, NOISE, PASSES, header, verdict
from runner.answers.trials import Trials
from runner.errors import UserError
from runner.files import write_text
from runner.measure import projection
from runner.measure.gpus import gpu_names
from runner.measure.memory import trainer_memory
from runner.precision import mode_of
from runner.tracking import dumps

MODES = ("fp8", "mxfp8", "nvfp4", "mxfp4")
RECIPE_FILE, RESULT_FILE = "recipe.yaml", "recipe_search.json"
DEFAULT_GPUS = ["H100", "B200"]
TAIL = 0.25  # the share of the last steps whose mean loss is compared
RANK_STEPS = 4  # candidate 0 measures at its first step and every steps // RANK_STEPS after


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
    if cfg.precision.fp32_modules == "auto":
        raise UserError(
            "precision.fp32_modules=auto is invalid here: name the fp32 islands "
            "(python -m runner.islands finds them), or drop it"
        )
    return mode_of(mode).compute


def tail_loss(rows: list[dict]) -> float:
    """The mean loss over the last TAIL of `rows`' steps (at least one)."""
    last = rows[-max(1, round(len(rows) * TAIL)) :]
    return sum(r["loss"] for r in last) / len(last) if last else math.nan


def outcome(gaps: list[float], tolerance: float, noise: float | None) -> str:
    """A candidate's outcome from its gaps, on every seed or on the config's alone (`noise`:
    candidate 0's spread over the seeds; None: one seed, not measured)."""
    if not all(math.isfinite(g) for g in gaps):
        return FAILS
    if len(gaps) > 1:
        return PASSES if max(gaps) <= tolerance else FAILS if min(gaps) > tolerance else NOISE
    if gaps[0] <= tolerance:
        return PASSES
    return FAILS if noise is None or gaps[0] - tolerance > noise else NOISE


class RecipeSearch:
    """One config's search: its trials, the bf16 reference and its noise, the candidates."""

    def __init__(self, cfg: DictConfig, out: Path):
        self.compute = check(cfg)
        self.cfg, self.out = cfg, out
        self.trials = Trials(cfg, out, cfg.runner.recipe_steps)
        self.islands = list(cfg.precision.fp32_modules)
        self.tolerance = float(cfg.compare.tolerance)
        self.gpus = gpu_names(cfg.runner.project or DEFAULT_GPUS)
        self.entries: dict[str, dict] = {}  # the projection's runs, by candidate
        self.converted: dict[int, dict] = {}  # each candidate's converted Linears: the export's
        self.seeds = [cfg.seed + i for i in range(cfg.runner.recipe_seeds)]
        self.bf16: dict[int, float] = {}  # bf16's tail loss, by seed
        self.noise: dict = {"seeds": self.seeds, "spread": None}

    def run(self, name: str, seed: int | None = None, **mode) -> tuple[dict, object]:
        """A trial named `name` (on `seed`; `mode`: precision keys, matmul_error off unless
        given), its projection entry kept by name."""
        summary, trainer = self.trials.fit(
            self.islands, seed=seed, **{"matmul_error": False} | mode
        )
        self.trials.trials[-1]["name"] = name
        summary["folder"] = self.trials.trials[-1]["folder"]
        rows = trainer.meter.rows
        self.entries[name] = projection.run_entry(
            summary | {"memory": trainer_memory(trainer)},
            trainer.meter.audited_steps[-1],
            self.cfg.dataset.get("batch_size"),
            rows[-1] if rows else None,
        )
        return summary, trainer

    def gap(self, rows: list[dict], seed: int, summary: dict) -> float:
        """A run's gap to bf16 on `seed` (NaN where it stopped short)."""
        if "stopped" in summary or summary["steps"] < self.trials.steps:
            return math.nan
        return (tail_loss(rows) - self.bf16[seed]) / abs(self.bf16[seed])

    def again(self, k: int, **mode) -> list[float]:
        """Candidate k's gaps on each seed after the config's."""
        gaps = []
        for seed in self.seeds[1:]:
            summary, trainer = self.run(f"candidate {k} seed {seed}", seed, **mode)
            gaps.append(self.gap(trainer.meter.rows, seed, summary))
        return gaps

    def reference(self) -> None:
        """bf16 on every seed: `bf16`, each one's tail loss."""
        for seed in self.seeds:
            name = "bf16" if seed == self.cfg.seed else f"bf16 seed {seed}"
            _, trainer = self.run(name, seed, mode="bf16", stages=[])
            self.bf16[seed] = tail_loss(trainer.meter.rows)

    def candidate(self, k: int, units: list[dict]) -> dict:
        """Candidate k: the run with `units` kept in bf16 (its recipe file beside it), judged."""
        recipe = self.out / f"candidate-{k}.yaml"
        self.out.mkdir(parents=True, exist_ok=True)
        write_text(recipe, yaml.safe_dump({"rules": rules(units)}, sort_keys=False))
        mode = {"recipe": str(recipe.resolve())}
        summary, trainer = self.run(f"candidate {k}", **mode)
        return self.judge(k, units, summary, trainer, mode)

    def judge(self, k: int, units: list[dict], summary: dict, trainer, mode: dict) -> dict:
        """Candidate k's record; within the tolerance on the config's seed, run on the others."""
        gaps = [self.gap(trainer.meter.rows, self.cfg.seed, summary)]
        if k == 0 and len(self.seeds) > 1:  # the noise
            gaps += self.again(0, **mode)
            finite = [g for g in gaps if math.isfinite(g)]
            self.noise["spread"] = max(finite) - min(finite) if len(finite) > 1 else None
        elif gaps[0] <= self.tolerance and len(self.seeds) > 1:
            gaps += self.again(k, **mode)
        result = outcome(gaps, self.tolerance, self.noise["spread"])
        flops = summary.get("flops_per_step")
        self.converted[k] = trainer.precision.converted.report()
        return {
            "k": k,
            "kept_bf16": [f"{u['module']} {u['direction']}" for u in units],
            "folder": summary["folder"],
            "final_loss": summary["final_loss"],
            "tail_loss": tail_loss(trainer.meter.rows),
            "loss_gap": gaps[0],
            "loss_gaps": dict(zip(self.seeds, gaps, strict=False)),  # by seed, where run
            "outcome": result,
            "passes": result == PASSES,
            "converted_flop_share": (summary.get("converted_flops_per_step") or 0) / flops
            if flops
            else None,
        }


def search(cfg: DictConfig, out: Path) -> dict:
    """The recipe for `cfg`: the runs in `out/trial-N/` (their recipes `out/candidate-k.yaml`),
    the result returned and written to `out/recipe_search.json`; `out/recipe.yaml` and its
    exported forms where a candidate passed."""
    s = RecipeSearch(cfg, out)
    for stale in (RECIPE_FILE, recipe_export.FILTER_FILE, recipe_export.TORCHTITAN_FILE):
        (out / stale).unlink(missing_ok=True)  # never a recipe these runs did not pass
    # the mode as configured, each matmul's error measured at several steps: it ranks the units
    every = max(1, s.trials.steps // RANK_STEPS)
    summary, trainer = s.run("candidate 0", matmul_error=True, error_every_n_steps=every)
    ranked = rank(trainer.errors.records, s.compute)
    s.reference()
    candidates = [s.judge(0, [], summary, trainer, {})]
    units = ladder(ranked)
    cap = min(cfg.runner.recipe_max, len(units))
    while not candidates[-1]["passes"] and len(candidates) <= cap:
        candidates.append(s.candidate(len(candidates), units[: len(candidates)]))
    noise = s.noise["spread"]
    projected = projection.project(s.entries, s.gpus)
    for c in candidates:
        c["within_noise_of"] = [
            d["k"]
            for d in candidates[: c["k"]]
            if noise is not None and abs(c["loss_gap"] - d["loss_gap"]) <= noise
        ]
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
        "tail_share": TAIL,
        "recipe_max": cfg.runner.recipe_max,
        "bf16_tail_losses": s.bf16,
        "noise": s.noise,
        "ranked": ranked,
        "candidates": candidates,
        "found": found is not None,
        "gpus": s.gpus,
        **s.trials.cpu,  # the threads every trial trained with
        "trials": s.trials.trials,
    }
    if found:
        recipe = out / RECIPE_FILE
        body = yaml.safe_dump({"rules": rules(units[: found["k"]])}, sort_keys=False)
        write_text(recipe, header(result) + body)
        source = f"precision={cfg.precision.mode} recipe found by python -m runner.recipe: {recipe}"
        prefix = recipe_export.prefix_of(list(s.trials.initial))
        report = s.converted[found["k"]]
        exported = recipe_export.write(out, cfg.precision.mode, report, source, prefix)
        result |= {"recipe": str(recipe), "exported": [str(p) for p in exported]}
    result["verdict"] = verdict(result, found)
    write_text(out / RESULT_FILE, dumps(result, indent=2) + "\n")
    return result
