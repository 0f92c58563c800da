"""`python -m runner.recipe precision=MODE [overrides]`: what a model must keep in higher precision
to train in MODE, with the overrides `python -m runner` takes. Exit 0: found; 1: no small set; 2:
bad input; 75: stopped by SIGTERM, SIGUSR1 or SIGUSR2 (its trials keep no checkpoints: the same
command searches again). One search at a time in its output folder (its lock: runner/folders.py).

- A converting mode (fp8, mxfp8, nvfp4, mxfp4): the smallest set of module × direction units kept
  in bf16 to train within the loss tolerance of bf16 on every seed of runner.recipe_seeds
  (runner/answers/recipe_search.py); it prints the ranking, the noise and the candidates, and
  writes recipe.yaml with its forms for torchao and torchtitan (where one passed;
  runner/answers/recipe_export.py) and recipe_search.json in its output folder. Exit 1 also
  where its runs cannot tell a candidate from the tolerance.
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
from runner.errors import Preempted, UserError, fail

RANKED_SHOWN = 8
_command = "recipe"  # the name it was run as (main's argument): recipe or islands


def recipe_markdown(result: dict) -> str:
    """The worst units (their SQNR over the measured steps, ties), the bf16 seeds' noise, the
    candidates as a table, the files written, then the verdict."""
    ranked = result["ranked"]
    lines = [f"ranked by measured error ({len(ranked)} units in the format), worst first:"]
    for u in ranked[:RANKED_SHOWN]:
        low, high = u["sqnr_range_db"]
        tie = f" [tie {u['tie']}]" if u["tie"] else ""
        lines.append(
            f"  {u['module']} {u['direction']}: SQNR {u['sqnr_db']:.1f} ± "
            f"{u['sqnr_spread_db']:.1f} dB over {len(u['steps'])} steps ({low:.1f} to "
            f"{high:.1f}), {u['underflow']:.1%} of an operand flushed to zero{tie}"
        )
    if any(u["tie"] for u in ranked[:RANKED_SHOWN]):
        lines.append(
            "  (a tie: units whose mean SQNRs differ by less than their spread over the steps; "
            "their order is not measured)"
        )
    noise = result["noise"]
    bf16 = ", ".join(f"{seed}: {tail:.4g}" for seed, tail in result["bf16_tail_losses"].items())
    spread = "not measured" if noise["spread"] is None else f"{noise['spread']:.2%}"
    gpus = result["gpus"]
    lines += [
        f"bf16's mean loss over the last steps, by seed: {bf16}; the noise (candidate 0's gap "
        f"spread over the seeds): {spread}",
        "",
        "| candidate | kept in bf16 | loss gap to bf16 (by seed) | outcome | within noise of | "
        "FLOPs in format | " + " | ".join(f"{g} vs bf16 (est.)" for g in gpus) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(gpus),
    ]
    for c in result["candidates"]:
        kept = ", ".join(c["kept_bf16"]) or "nothing"
        share = c["converted_flop_share"]
        speeds = " | ".join(
            "n/a" if (x := c["projected"][g]["speedup_vs_bf16"]) is None else f"{x:.2f}x"
            for g in gpus
        )
        near = ", ".join(map(str, c["within_noise_of"])) or "-"
        gaps = ", ".join(f"{g:+.2%}" for g in c["loss_gaps"].values())
        lines.append(
            f"| {c['k']} ({c['folder']}) | {kept} | {gaps} | {c['outcome']} | "
            f"{near} | {'?' if share is None else f'{share:.1%}'} | {speeds} |"
        )
    if result["found"]:
        lines += ["", "written: " + ", ".join([result["recipe"], *result["exported"]])]
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
    from hydra.core.hydra_config import HydraConfig

    from runner import folders

    out = Path(HydraConfig.get().runtime.output_dir)
    try:  # one search in a folder (its trials, recipe.yaml, result), before the heavy imports
        folders.hold(out)
    except UserError as e:
        fail(e)
    from runner.answers import island_search, recipe_search  # heavy: the command line is good
    from runner.train.preemption import Signals

    recipe = _command == "recipe" and cfg.precision.mode in recipe_search.MODES
    try:
        folders.write_hydra_files(out, cfg)  # what the search ran, as a run records it
        # a signal between trials stops the search at once, one in a trial after its step
        with Signals("setup").installed():
            result = (recipe_search if recipe else island_search).search(cfg, out)
    except UserError as e:
        fail(e)
    except Preempted as e:
        at = f" at step {e.step} of a trial" if e.step is not None else ""
        print(
            f"preempted by {e.signal_name}{at}: the search stopped, and its trials keep no "
            "checkpoints; to continue: run the same command (the search starts again)",
            file=sys.stderr,
        )
        sys.exit(e.exit_code)
    finally:
        folders.release(out)
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
        _hold_early(sys.argv[1:])
        preflight(sys.argv[1:])
    except UserError as e:
        fail(e)
    job()


def _hold_early(args: list[str]) -> None:
    """An explicit hydra.run.dir that exists is taken before the checks (seconds of imports), so
    that a second search into a searching folder is refused at once; `job` takes any other."""
    import os

    from runner import folders

    for arg in args:
        key, _, value = arg.partition("=")
        if key == "hydra.run.dir" and "${" not in value and Path(value).is_dir():
            folders.hold(Path(os.path.abspath(value)))  # as Hydra makes its output_dir


if __name__ == "__main__":
    main()
