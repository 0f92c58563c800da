"""`python -m runner.islands [overrides]`: the fp32 islands a model needs to train in its
precision (runner/answers/island_search.py), with the overrides `python -m runner` takes. It
prints the trials and the config line to use, and writes islands.json in its output folder."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from runner.config.commandline import is_multirun
from runner.config.preflight import preflight
from runner.errors import UserError, fail


def markdown(result: dict) -> str:
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


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def job(cfg: DictConfig) -> None:
    from runner.answers import island_search  # heavy: the command line is good
    from runner.run import output_dir

    try:
        result = island_search.search(cfg, output_dir(None))
    except UserError as e:
        fail(e)
    print(markdown(result))


def main() -> None:
    try:
        if is_multirun(sys.argv[1:]):
            raise UserError("python -m runner.islands searches one config: drop -m and the sweep")
        preflight(sys.argv[1:])
    except UserError as e:
        fail(e)
    job()


if __name__ == "__main__":
    main()
