"""`python -m runner.project [overrides]`: each precision's projected step time, tokens/s, MFU,
speedups and max batch on named GPUs (runner/measure/projection.py), without training: one
audited step (and one timed step) per precision of runner.project_precisions (default fp32,
bf16, fp8) on this machine, projected on runner.project (default H100 and B200). With `-m`, a
sweep (`-m model.hidden_size=256,1024,4096`) projects each point and says where fp8's projected
speedup over bf16 passes 1.0×. Every figure is an estimate, never a measurement.

In a training run, `runner.project=[H100]` puts the same projection in summary.json
(`projection_for_run`)."""

from __future__ import annotations

import itertools
import sys
from contextlib import ExitStack
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

DEFAULT_PRECISIONS = ("fp32", "bf16", "fp8")
DEFAULT_GPUS = ("H100", "B200")
CONF = Path(__file__).resolve().parent.parent / "conf"


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
        precision.in_force.set_matmuls()
        quiet, console.console.quiet = console.console.quiet, True
        try:
            summary = trainer.fit() | {"memory": trainer_memory(trainer)}
        finally:
            console.console.quiet = quiet
        stage = trainer.meter.audited_steps[-1]
        rows = trainer.meter.rows
        return projection.run_entry(
            summary, stage, cfg.dataset.get("batch_size"), rows[-1] if rows else None
        )


def projection_for_run(cfg: DictConfig, summary: dict, meter) -> dict:
    """summary.json's `projection` for a run (`meter`: its trainer's Meter): its own last audited
    step, and one audited step of each precision of runner.project_precisions it did not run."""
    from runner.measure import projection

    gpus = projection.gpu_names(cfg.runner.project)
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


def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


def project_overrides(overrides: list[str]) -> dict:
    """The projection of one point: each precision composed with `overrides` and audited."""
    from runner.measure import projection

    base = _compose(overrides)
    precisions = list(base.runner.project_precisions) or list(DEFAULT_PRECISIONS)
    gpus = projection.gpu_names(base.runner.project or list(DEFAULT_GPUS))
    runs = {}
    for name in precisions:
        cfg = _compose([*overrides, f"precision={name}", "logger=none"])
        runs[name] = audit_precision(cfg)
    return projection.project(runs, gpus)


def sweep(overrides: list[str]) -> list[tuple[list[str], dict]]:
    """Each point of a Hydra sweep (`key=a,b,c`), in order, as its overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    axes = []
    for o in parsed:
        key = o.get_key_element()
        values = (
            list(o.sweep_string_iterator())
            if o.is_sweep_override()
            else [o.get_value_element_as_str()]
        )
        axes.append([f"{key}={v}" for v in values])
    return [list(point) for point in itertools.product(*axes)]


def crossovers(points: list[tuple[list[str], dict]], swept: str) -> list[str]:
    """Where fp8's projected speedup over bf16 passes 1.0×, per GPU, along `swept`."""
    from runner.measure import projection

    lines = []
    gpus = list(points[0][1]) if points else []
    for gpu in gpus:
        series = []
        for overrides, projected in points:
            value = next(o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == swept)
            speedup = projected[gpu].get("fp8", {}).get("speedup_vs_bf16")
            series.append((float(value), speedup))
        found = projection.crossover(series)
        shown = ", ".join(f"{v:g}: {s:.2f}×" if s else f"{v:g}: —" for v, s in sorted(series))
        verdict = (
            f"passes 1.0× at {swept}={found:g}" if found is not None else "never passes 1.0× here"
        )
        lines.append(f"{gpu}: fp8 over bf16 (projected) {verdict} ({shown})")
    return lines


def main(argv: list[str]) -> int:
    from runner.errors import UserError, fail

    multirun = any(a in ("-m", "--multirun") for a in argv)
    overrides = [a for a in argv if a not in ("-m", "--multirun")]
    try:
        if not multirun:
            show(project_overrides(overrides))
            return 0
        points = []
        for point in sweep(overrides):
            projected = project_overrides(point)
            show(projected, " ".join(point))
            points.append((point, projected))
        swept = [o.split("=", 1)[0] for o in overrides if "," in o.split("=", 1)[-1]]
        swept = [k for k in swept if not k.startswith("runner.project")]
        if swept:
            for line in crossovers(points, swept[0]):
                print(line)
    except UserError as e:
        fail(e)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
