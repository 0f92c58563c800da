"""What precision.autopilot did over a run (runner/precision/autopilot.py decides): summary.json's
`autopilot` (its switches, the share of the run's FLOPs in the format, weighted by steps, and what
its measured steps cost), the tracker's table of switches, and the recipe the run ended with,
written beside the run (`autopilot_recipe.yaml`) for `precision.recipe=` to apply."""

from __future__ import annotations

import statistics

import yaml

from runner import console
from runner.files import write_text
from runner.precision.autopilot import FINAL
from runner.precision.recipe import DIRECTIONS

RECIPE_FILE = "autopilot_recipe.yaml"
COLUMNS = ["step", "module", "directions", "measured", "crossed"]


def report(trainer, precision, log) -> dict:
    """summary.json's `autopilot` (nothing where it is off); the recipe file written, the
    switches' table sent, and a line said. Each step's row has its low_flop_share; the trainer's
    MatmulErrors (runner/measure/error_table.py) timed the autopilot's measured steps."""
    autopilot, converted, rows = precision.autopilot, precision.converted, trainer.meter.rows
    if autopilot is None:
        return {}
    measured = [s for s in autopilot.switches if s.measured != FINAL]
    shares = [r["low_flop_share"] for r in rows if "low_flop_share" in r]
    share = statistics.fmean(shares) if shares else None
    steady = [r["step_time_s"] for r in rows if r.get("steady")]
    step_s = statistics.median(steady) if steady else None
    count, seconds = trainer.errors.piloted
    overhead = seconds - count * step_s if step_s is not None and count else None
    path = log.out_dir / RECIPE_FILE
    write_text(path, recipe_text(converted, measured))
    table = [
        [s.step, s.module, "+".join(s.directions), s.measured, s.crossed]
        for s in autopilot.switches
    ]
    log.log_table("autopilot_switches", COLUMNS, table)
    fmt = converted.compute
    said = f"{share:.1%} of the run's FLOPs in {fmt}" if share is not None else "no step counted"
    console.say(
        f"autopilot: {len(measured)} unit(s) moved to bf16 by their measurements"
        + (
            f", the last {autopilot.cfg.final_bf16:.0%} of the steps all bf16"
            if autopilot.cfg.final_bf16
            else ""
        )
        + f"; {said}; the recipe it ended with: {path} (precision.recipe={path} applies it)"
    )
    final = _final_phase(autopilot, rows)
    return {
        "autopilot": {
            **final,
            "switches": [dict(zip(COLUMNS, row, strict=True)) for row in table],
            "units_switched": len(measured),
            "low_flop_share": share,
            "format": fmt,
            "recipe": str(path),
            "measured_steps": count,
            "measured_steps_s": seconds,
            # their time beyond as many steady steps: what the autopilot's measuring cost
            "overhead_s": overhead,
            "overhead_share": overhead / sum(r["step_time_s"] for r in rows) if overhead else None,
        }
    }


def recipe_text(converted, switches) -> str:
    """The recipe the run ended with: a rule for each Linear the autopilot moved (its formats as
    they ended, before any final phase), then the user's own recipe's rules and default; the
    shorthands (skip, keep_bf16, min_features) are the config's, applied as before."""
    ended: dict[str, tuple] = {}
    for s in switches:
        ended[s.module] = converted.plan_at(s.step)[s.module]
    rules = [{"module": name, **dict(zip(DIRECTIONS, f, strict=True))} for name, f in ended.items()]
    rules += [
        {rule.on: rule.pattern, **dict(zip(DIRECTIONS, rule.formats, strict=True))}
        for rule in converted.user_rules
    ]
    out: dict = {"rules": rules}
    if converted.user_default is not None:
        out["default"] = dict(zip(DIRECTIONS, converted.user_default.formats, strict=True))
    head = "# written by precision.autopilot: the Linears it moved to bf16, then your own rules\n"
    return head + yaml.safe_dump(out, sort_keys=False)


def _final_phase(autopilot, rows: list[dict]) -> dict:
    """final_bf16's effect in the run's own figures: the mean training loss over its steps and
    over as many steps just before them (the format's)."""
    starts = [s.step for s in autopilot.switches if s.measured == FINAL]
    if not starts:
        return {}
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    inside = [v for step, v in losses.items() if step >= starts[0]]
    before = [v for step, v in losses.items() if starts[0] - len(inside) <= step < starts[0]]
    return {
        "final_bf16_from_step": starts[0],
        "final_bf16_loss": statistics.fmean(inside) if inside else None,
        "loss_before_final_bf16": statistics.fmean(before) if before else None,
    }
