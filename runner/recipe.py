"""`python -m runner.recipe precision=MODE [overrides]`: what a model must keep in higher precision
to train in MODE, with the overrides `python -m runner` takes. Exit 0: found; 1: no small set; 2:
bad input.

- A converting mode (fp8, mxfp8, nvfp4, mxfp4): the smallest set of module × direction units kept
  in bf16 to train within the loss tolerance of bf16 (runner/answers/recipe_search.py); it prints
  the ranking and the candidates, and writes recipe.yaml (where one passed) and
  recipe_search.json in its output folder.
- fp16 (and the other autocast modes): the fp32 islands (runner/answers/island_search.py); it
  prints the trials and the config line to use, and writes islands.json. `python -m
  runner.islands` is this case under its own name, whatever the mode."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from runner.config.commandline import is_multirun
from runner.config.preflight import preflight
from runner.errors import UserError, fail

RANKED_SHOWN = 8
_command = "recipe"  # the name it was run as (main's argument): recipe or islands


def recipe_markdown(result: dict) -> str:
    """The worst units, the candidates as a table, then the verdict."""
    lines = [
        f"ranked by measured error ({len(result['ranked'])} units in the format), worst first:"
    ]
    for u in result["ranked"][:RANKED_SHOWN]:
        lines.append(
            f"  {u['module']} {u['direction']}: SQNR {u['sqnr_db']:.1f} dB, "
            f"{u['underflow']:.1%} of an operand flushed to zero"
        )
    gpus = result["gpus"]
    lines += [
        "",
        "| candidate | kept in bf16 | loss gap to bf16 | passes | FLOPs in format | "
        + " | ".join(f"{g} vs bf16 (est.)" for g in gpus)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(gpus),
    ]
    for c in result["candidates"]:
        kept = ", ".join(c["kept_bf16"]) or "nothing"
        share = c["converted_flop_share"]
        speeds = " | ".join(
            "n/a" if (x := c["projected"][g]["speedup_vs_bf16"]) is None else f"{x:.2f}x"
            for g in gpus
        )
        lines.append(
            f"| {c['k']} ({c['folder']}) | {kept} | {c['loss_gap']:+.2%} | "
            f"{'yes' if c['passes'] else 'no'} | {'?' if share is None else f'{share:.1%}'} | "
            f"{speeds} |"
        )
    return "\n".join([*lines, "", result["verdict"]])


def islands_markdown(result: dict) -> str:
    """The trials as a table, then the verdict."""
    from runner.answers import island_search

    lines = [
        "| trial | fp32 modules | outcome | final loss | fp32 FLOPs |",
        "|---|---|---|---|---|",
    ]
    for t in result["trials"]:
        islands = ", ".join(t["fp32_modules"]) or "none"
        if t["kind"] == "replay":
            outcome = "finite" if t["finite"] else f"non-finite at {t['first_nonfinite']}"
            lines.append(f"| replay of step {t['step']} | {islands} | {outcome} | | |")
            continue
        skipped = f"{t['skipped_steps']} of {t['steps']} steps skipped"
        if t["calibration_steps"]:
            skipped += f", {t['calibration_steps']} while the loss scale calibrated"
        run = f"{t['precision']} run ({t['folder']})"
        if t["kind"] == "rerun":
            run = f"{t['precision']} run to step {t['for_step']} ({t['folder']})"
            outcome = f"the weights step {t['for_step']} saw"
        elif t["trains"]:
            outcome = f"trains ({skipped})"
        elif "stopped" in t:
            outcome = f"stops at step {t['steps']} ({skipped})"
        else:
            outcome = f"{t.get('fault', 'ends non-finite')} ({skipped})"
        lines.append(
            f"| {run} | {islands} | {outcome} | {t['final_loss']:.4g} "
            f"| {island_search.percent(t['fp32_flop_share'])} |"
        )
    return "\n".join([*lines, "", result["verdict"]])


# conf/ by its path: run as runner.islands, Hydra would look for it beside that module
@hydra.main(
    version_base="1.3", config_path=str(Path(__file__).parents[1] / "conf"), config_name="config"
)
def job(cfg: DictConfig) -> None:
    from runner import folders
    from runner.answers import island_search, recipe_search  # heavy: the command line is good
    from runner.run import output_dir

    recipe = _command == "recipe" and cfg.precision.mode in recipe_search.MODES
    folders.write_hydra_files(output_dir(None), cfg)  # what the search ran, as a run records it
    try:
        if recipe:
            result = recipe_search.search(cfg, output_dir(None))
        else:
            result = island_search.search(cfg, output_dir(None))
    except UserError as e:
        fail(e)
    print(recipe_markdown(result) if recipe else islands_markdown(result))
    if not result["found"]:
        sys.exit(1)


def main(command: str = "recipe") -> None:
    global _command
    _command = command
    try:
        if is_multirun(sys.argv[1:]):
            raise UserError(
                f"python -m runner.{command} searches one config: drop -m and the sweep"
            )
        preflight(sys.argv[1:])
    except UserError as e:
        fail(e)
    job()


if __name__ == "__main__":
    main()
