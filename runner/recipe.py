"""`python -m runner.recipe precision=nvfp4 [overrides]`: the smallest set of module × direction
units a converting mode (fp8, mxfp8, nvfp4, mxfp4) must keep in bf16 to train within the loss
tolerance of bf16 (runner/answers/recipe_search.py), with the overrides `python -m runner` takes.
It prints the ranking and the candidates, and writes recipe.yaml (where one passed) and
recipe_search.json in its output folder. Exit 0: a recipe found; 1: no small set; 2: bad input."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from runner.config.commandline import is_multirun
from runner.config.preflight import preflight
from runner.errors import UserError, fail

RANKED_SHOWN = 8


def markdown(result: dict) -> str:
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


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def job(cfg: DictConfig) -> None:
    from runner.answers import recipe_search  # heavy: the command line is good
    from runner.run import output_dir

    try:
        result = recipe_search.search(cfg, output_dir(None))
    except UserError as e:
        fail(e)
    print(markdown(result))
    if not result["found"]:
        sys.exit(1)


def main() -> None:
    try:
        if is_multirun(sys.argv[1:]):
            raise UserError("python -m runner.recipe searches one config: drop -m and the sweep")
        preflight(sys.argv[1:])
    except UserError as e:
        fail(e)
    job()


if __name__ == "__main__":
    main()
