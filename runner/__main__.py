"""`python -m runner [overrides]`: one run, or a sweep with `-m` (compared when it ends)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner import console
from runner.compare import CompareCallback
from runner.config.commandline import (
    informational,
    is_multirun,
    normalized,
    seed_round,
    sweep_keys,
)
from runner.config.preflight import preflight
from runner.errors import Preempted, UserError, fail, first_line
from runner.tracking import SWEEP_KEYS_ENV


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def job(cfg: DictConfig) -> float | None:
    from runner.run import run  # heavy imports after the command line is known to be good
    from runner.train.preemption import run_begins

    stop_here("before job {num} started")  # a signal at an auto sweep's look
    run_begins()
    try:
        final_loss = run(cfg)["final_loss"]
        stop_here()
        return final_loss
    except Preempted as e:  # stops a sweep too: the cluster wants the machine back
        print(f"{e}; {how_to_continue()}", file=sys.stderr)
        from runner.train.preemption import hand_on

        hand_on(e.signal_name)  # submitit's requeue, under +launcher=slurm
        sys.exit(e.exit_code)
    except Exception as e:
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            if isinstance(e, UserError):
                fail(e)
            raise
        # One failed job does not stop the sweep: its summary.json says why, and the comparison
        # at the end reports it (and the command exits non-zero).
        print(f"error: job {HydraConfig.get().job.num} failed: {first_line(e)}", file=sys.stderr)
        from runner.train.distributed import from_env

        if from_env().enabled:
            # Under DDP the job fails with any rank: this task exits non-zero (a return, or an
            # exception, would be a result to Hydra and submitit: "completed"), so srun ends the
            # step, SLURM records the job FAILED, the sweep names it and a rerun resumes it.
            sys.exit(1)
        return None


def stop_here(when: str = "as job {num} completed") -> None:
    """A signal that came as the job completed (in its last step, its evaluation, its summary),
    or between jobs (`when`): where this process goes on to the sweep's next job (the basic
    launcher), the sweep stops there, exit 75, as if it had come a moment later. Elsewhere the
    job's process ends anyway."""
    from runner.train.distributed import from_env
    from runner.train.preemption import hand_on, late

    name = late()
    in_process = os.getpid() == SWEEP_PID and not from_env().enabled  # ranks decide together
    if name is None or HydraConfig.get().mode != RunMode.MULTIRUN or not in_process:
        return
    said = when.format(num=HydraConfig.get().job.num)
    print(f"{name} {said}: the sweep stops here; {how_to_continue()}", file=sys.stderr)
    hand_on(name)
    sys.exit(Preempted.exit_code)


def how_to_continue() -> str:
    """After a preemption: how the user continues this run, or the sweep it is a job of (run
    again in its folder, each job continues from its checkpoint)."""
    node = HydraConfig.get()
    if node.mode != RunMode.MULTIRUN:
        return "continue with trainer.resume=auto"
    if any(o.startswith("hydra.sweep.dir=") for o in node.overrides.hydra):
        return "continue the sweep: run the same command"
    return f"continue the sweep: run the same command with hydra.sweep.dir={node.sweep.dir}"


def absolute_sweep_dir(arg: str) -> str:
    """`hydra.sweep.dir=` made absolute: the jobs may run in another working folder (a Ray
    worker's), and must write where this process reads the sweep back."""
    key, _, value = arg.partition("=")
    if key != "hydra.sweep.dir" or "${" in value or Path(value).is_absolute():
        return arg
    return f"{key}={Path(value).absolute()}"


def stop_between(args: list[str], sweep_dir: str) -> None:
    """A signal at an auto sweep's look (runner/train/preemption.py's between_jobs noted it):
    the sweep stops before its next round, exit 75, saying how to continue it."""
    from runner.train.preemption import hand_on, late

    if (name := late()) is None:
        return
    named = any(a.startswith("hydra.sweep.dir=") for a in args)
    again = "" if named else f" with hydra.sweep.dir={sweep_dir}"
    print(
        f"{name} at the sweep's look: the sweep stops here; continue the sweep: run the same "
        f"command{again}",
        file=sys.stderr,
    )
    hand_on(name)
    sys.exit(Preempted.exit_code)


SWEEP_PID = os.getpid()  # the process that runs the command (and a basic sweep's every job)


def main() -> None:
    args = sys.argv[1:]
    console.quiet_torchao()  # checking the command line imports the tasks, and so torchao
    try:
        # precision.autopilot=true: its .enabled; runner.seeds=N: a seed sweep Hydra runs
        args = sys.argv[1:] = normalized(args)
        preflight(args)
        if is_multirun(args) and not informational(args):
            # Each job's W&B name and group carry its swept values: the keys travel in the jobs'
            # own config (Hydra sets env_set in the process that runs the job, a SLURM node or a
            # Ray worker too), not in this process's environment.
            keys = ",".join(sweep_keys(args))
            args = sys.argv[1:] = [
                *map(absolute_sweep_dir, args),
                f"++hydra.job.env_set.{SWEEP_KEYS_ENV}='{keys}'",
            ]
        from runner.train import distributed  # imports torch: after the quick checks

        ranks = distributed.init()  # under torchrun; one process: nothing to do
    except UserError as e:
        fail(e)
    launch = distributed.launch_overrides(ranks, args)
    sys.argv += launch
    try:
        job()
        # runner.seeds=auto: one more seed for the rows still undecided, until none is
        while CompareCallback.next_round:
            seed, blocks, sweep_dir = CompareCallback.next_round
            CompareCallback.next_round = None
            CompareCallback.ran.add(seed)
            lines = seed_round(args, seed, blocks, sweep_dir)
            for k, line in enumerate(lines):  # a multirun a block; the look after the last
                stop_between(args, sweep_dir)
                CompareCallback.deferred = k < len(lines) - 1
                sys.argv[1:] = [*line, *launch]
                job()
    finally:
        distributed.close(ranks)
    if CompareCallback.refused:
        sys.exit(2)
    if CompareCallback.failed_jobs:
        sys.exit(1)


if __name__ == "__main__":
    main()
