"""`python -m runner [overrides]`: one run, or a sweep with `-m`."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from runner.cli import fail, preflight
from runner.errors import UserError


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def job(cfg: DictConfig) -> float | None:
    from runner.run import run  # heavy imports after the command line is known to be good

    try:
        return run(cfg)["final_loss"]
    except UserError as e:
        fail(e)


def main() -> None:
    try:
        preflight(sys.argv[1:])
    except UserError as e:
        fail(e)
    job()


if __name__ == "__main__":
    main()
