"""`python -m runner.project [overrides]`: each precision's projected step time, tokens/s, MFU,
speedups and max batch on named GPUs (runner/measure/projection.py), without training: one
audited step (and one timed step) per precision of runner.project_precisions (default fp32,
bf16, fp8) on this machine, projected on runner.project (default H100 and B200). With `-m`, a
sweep (`-m model.hidden_size=256,1024,4096`) projects each point and says where fp8's projected
speedup over bf16 passes 1.0×. Every figure is an estimate, never a measurement.

In a training run, `runner.project=[H100]` puts the same projection in summary.json
(`projection_for_run`, runner/answers/projection.py)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

from omegaconf import DictConfig

from runner.answers.projection import audit_precision, show

DEFAULT_PRECISIONS = ("fp32", "bf16", "fp8")
DEFAULT_GPUS = ("H100", "B200")
CONF = Path(__file__).resolve().parent.parent / "conf"


def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


def project_overrides(overrides: list[str]) -> dict:
    """The projection of one point: each precision composed with `overrides` and audited."""
    from runner.config.preflight import preflight
    from runner.measure import projection
    from runner.measure.gpus import gpu_names

    preflight(list(overrides))  # a misspelt key or a bad value: one line, as in python -m runner
    base = _compose(overrides)
    precisions = list(base.runner.project_precisions) or list(DEFAULT_PRECISIONS)
    preflight([*overrides, f"precision={','.join(precisions)}", "logger=none"])
    gpus = gpu_names(base.runner.project or list(DEFAULT_GPUS))
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
    """Where fp8's projected speedup over bf16 passes 1.0×, per GPU, along `swept`. A point
    where fp8 converted no Linear is bf16's step, never a crossover: it shows as such."""
    from runner.measure import projection

    lines = []
    gpus = list(points[0][1]) if points else []
    for gpu in gpus:
        series, unconverted = [], set()
        for overrides, projected in points:
            value = float(
                next(o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == swept)
            )
            row = projected[gpu].get("fp8", {})
            if row.get("nothing_converted"):
                unconverted.add(value)
            series.append((value, None if value in unconverted else row.get("speedup_vs_bf16")))
        found = projection.crossover(series)
        shown = ", ".join(
            f"{v:g}: no Linear converted"
            if v in unconverted
            else (f"{v:g}: {s:.2f}×" if s else f"{v:g}: —")
            for v, s in sorted(series)
        )
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
