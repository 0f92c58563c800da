"""The searches' trials (the fp32 islands, runner/answers/island_search.py; the recipe,
runner/answers/recipe_search.py): short runs of one config in one process, each the user's run.

A trial is the first `steps` optimizer steps of the configured run, on its LR schedule, eagerly,
without evaluation or checkpoints. Its model is built as `python -m runner` builds it (seeded, by
its own constructor: runner/train/session.py `built`), so the hooks and parametrizations a user's
model sets up hold, its initial weights, random stream and CPU threads are a standalone run's, and it writes
the precision manifest a run writes (runner/measure/manifest.py) into its summary.json. A trial
whose plan did not hold stops the search: one line naming the first mismatch."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from runner.answers.island_criteria import calibration, fp32_share
from runner.errors import TrainingStopped, UserError, first_line
from runner.measure import manifest
from runner.precision import Precision
from runner.precision.caps import resolve_device
from runner.task import Task
from runner.tracking import RunLog
from runner.train.optim import build_optimizers
from runner.train.session import built
from runner.train.threads import Threads
from runner.train.trainer import Trainer


class Trials:
    """One config's trials: its data (the replays' batches) and initial weights built once, to
    check the config before any run; each trial's own built as its run would build them."""

    def __init__(self, cfg: DictConfig, out: Path, steps: int):
        self.cfg, self.out = cfg, out
        self.steps = min(cfg.trainer.max_steps, steps)
        self.device = resolve_device(cfg.trainer.device)
        # the threads a run would train with here (trainer.cpu_threads, else the free cores),
        # read once: every trial trains with them
        threads = Threads()
        self.cpu = threads.fit(cfg.trainer.cpu_threads, self.device)
        threads.restore()
        self.data, task = built(cfg)
        self.initial = task.state_dict()
        self.trials: list[dict] = []

    def task(self, weights: dict | None = None) -> Task:
        """The config's model built afresh (`built`), holding `weights` where given."""
        _, task = built(self.cfg)
        if weights is not None:
            task.load_state_dict(weights)
        return task

    def precision(
        self, task: torch.nn.Module, islands: list[str], **mode
    ) -> tuple[Precision, manifest.Plan]:
        """The trial's precision (`mode`: precision keys over the config's), `task` prepared in
        it with `islands` kept in fp32, and the manifest's plan, read before it converts."""
        precision = Precision(OmegaConf.merge(self.cfg.precision, mode), self.device)
        try:
            plan = manifest.Plan(task, precision)
            precision.prepare(task, islands)
        except BaseException:
            precision.close()
            raise
        return precision, plan

    def fit(
        self, islands: list[str], steps: int | None = None, seed: int | None = None, **mode
    ) -> tuple[dict, Trainer]:
        """A short run with `islands` kept in fp32 (in `mode`'s precision keys where given; its
        first `steps` steps where given; on `seed` where given, data and model built from it as
        a run with that seed builds them): its summary, with `stopped` where it stopped itself
        and its manifest, and its trainer (whose task holds the weights of the last step
        applied). Recorded in `trials` with `trains` where it ends finite."""
        folder = self.out / f"trial-{len(self.trials)}"
        cfg = self.cfg if seed is None else OmegaConf.merge(self.cfg, {"seed": seed})
        data, task = built(cfg)
        task.to(self.device)
        precision, plan = self.precision(task, islands, **mode)
        log = RunLog(folder)
        stopped, threads = None, torch.get_num_threads()
        torch.set_num_threads(self.cpu["cpu_threads"])
        try:
            groups = precision.optimizer_groups(task.parameter_groups())
            # The configured run's schedule: a trial is its first steps.
            optimizers, schedulers = build_optimizers(cfg.optim, groups, cfg.trainer.max_steps)
            short = OmegaConf.merge(
                cfg.trainer,
                {"max_steps": steps or self.steps, "val_check_interval": 0, "progress_bar": False},
            )
            trainer = Trainer(
                short, task, data, precision, optimizers, schedulers, log, self.device
            )
            trainer.checkpointer.save = lambda *args: None  # a trial keeps no checkpoints
            plan.started()
            try:
                trainer.fit()
            except TrainingStopped as e:
                stopped = first_line(e)
            summary = trainer.summary() | ({"stopped": stopped} if stopped else {})
            held = manifest.build(trainer.meter.audited_steps, plan, None)
        finally:
            precision.close()
            torch.set_num_threads(threads)
        summary |= {"precision_manifest": held, "plan_held": held["plan_held"]}
        loss = summary["final_loss"]
        log.finish(summary)
        self.trials.append(
            {
                "kind": "run",
                "folder": folder.name,
                "precision": precision.name,
                "fp32_modules": list(islands),
                **({"seed": seed} if seed is not None else {}),
                "trains": stopped is None and loss is not None and math.isfinite(loss),
                "steps": summary["steps"],
                "skipped_steps": summary["skipped_steps"],
                "calibration_steps": calibration(trainer.meter.rows),
                "final_loss": loss,
                "fp32_flop_share": fp32_share(summary),
                "plan_held": held["plan_held"],
                **({"stopped": stopped} if stopped else {}),
            }
        )
        if not held["plan_held"]:
            more = len(held["mismatches"]) - 1
            raise UserError(
                f"{folder.name} ({precision.name}) did not run as planned: "
                f"{held['mismatches'][0]}"
                + (f" (and {more} more" if more else " (")
                + f": {folder / 'summary.json'}'s precision_manifest)"
            )
        return summary, trainer
