"""The projection of a run onto GPUs it did not run on (runner/measure/projection.py's model):
one audited step (and one timed step) of a precision in a throwaway trainer, a training run's
own projection for summary.json (`runner.project=[H100]`), and the console's table of it.
`python -m runner.project` (runner/project.py) projects without training."""

from __future__ import annotations

from contextlib import ExitStack

from omegaconf import DictConfig, OmegaConf


def audit_precision(cfg: DictConfig) -> dict:
    """One audited step and one timed step of `cfg` in a throwaway trainer (as runner.max_batch
    measures): the projection's entry for its precision (runner.measure.projection.run_entry)."""
    from runner import console
    from runner.measure import projection
    from runner.measure.memory import trainer_memory
    from runner.train.optim import build_optimizers
    from runner.train.session import prepared, workspace
    from runner.train.trainer import Trainer

    with ExitStack() as stack:
        device, data, task, log = workspace(cfg, stack)
        variant, precision = prepared(cfg, task, device, stack)
        groups = precision.optimizer_groups(variant.parameter_groups())
        optimizers, schedulers = build_optimizers(cfg.optim, groups, cfg.trainer.max_steps)
        timing = OmegaConf.merge(
            cfg.trainer,
            {
                "max_steps": 2,
                "log_every_n_steps": 1,
                "val_check_interval": 0,
                "checkpoint_every_n_steps": 0,
                "progress_bar": False,
                "benchmark": {"warmup_steps": 1},
            },
        )
        trainer = Trainer(timing, variant, data, precision, optimizers, schedulers, log, device)
        trainer.checkpointer.save = lambda *args: None
        trainer.errors.enabled = False  # a throwaway: its matmuls' error is the run's to measure
        precision.in_force.set_matmuls()
        quiet, console.console.quiet = console.console.quiet, True
        try:
            summary = trainer.fit() | {"memory": trainer_memory(trainer)}
        finally:
            console.console.quiet = quiet
        if precision.converted:  # its Linears converted and skipped, as a run's summary has them
            summary["converted"] = precision.converted.report()
        stage = trainer.meter.audited_steps[-1]
        rows = trainer.meter.rows
        return projection.run_entry(
            summary, stage, cfg.dataset.get("batch_size"), rows[-1] if rows else None
        )


def projection_for_run(cfg: DictConfig, summary: dict, meter) -> dict:
    """summary.json's `projection` for a run (`meter`: its trainer's Meter): its own last audited
    step, and one audited step of each precision of runner.project_precisions it did not run."""
    from runner.measure import projection
    from runner.measure.gpus import gpu_names

    gpus = gpu_names(cfg.runner.project)
    stage = meter.audited_steps[-1]
    row = meter.rows[-1] if meter.rows else None
    runs = {stage["mode"]: projection.run_entry(summary, stage, cfg.dataset.get("batch_size"), row)}
    for name in cfg.runner.project_precisions:
        if name not in runs:
            other = OmegaConf.merge(cfg, {"precision": {"mode": name}, "runner": {"project": None}})
            runs[name] = audit_precision(other)
    return projection.project(runs, gpus)


def show(projected: dict, title: str = "") -> None:
    from runner import console
    from runner.measure import projection

    rows = projection.table(projected)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    console.say(
        f"projected (an estimate from this machine's audited step, never measured on these GPUs)"
        f"{': ' + title if title else ''}"
    )
    for row in rows:
        text = "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
        console.console.print(f"  {text.rstrip()}", soft_wrap=True, highlight=False, markup=False)
    for note in projection.notes(projected):  # a mode that converted no Linear, and why
        console.console.print(f"  {note}", soft_wrap=True, highlight=False, markup=False)
