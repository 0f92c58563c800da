"""The precision manifest as people read it: by module and by class in summary.json, a short
table after the audited step, its mismatches as warnings, and every op as a tracker's table."""

from __future__ import annotations

from collections.abc import Iterable

from rich.markup import escape

from runner import console
from runner.measure.matmuls import FORWARD, INPUT_GRAD, RECOMPUTE, WEIGHT_GRAD


def by_module(ops: list[dict]) -> dict[str, dict]:
    modules: dict[str, dict] = {}
    for r in ops:
        entry = modules.setdefault(r["module"], {"class": r["class"], "ops": []})
        entry["ops"].append({k: v for k, v in r.items() if k not in ("module", "class")})
    return modules


def by_class(ops: Iterable[dict]) -> list[dict]:
    """One row per (class, direction, format, inputs): the modules it covers and its FLOPs."""
    rows: dict[tuple, dict] = {}
    total = sum(r["flops"] for r in ops) or 1
    for r in ops:
        key = (r["class"], r["direction"], r["format"], tuple(r["inputs"]))
        row = rows.setdefault(
            key,
            {
                "class": r["class"],
                "direction": r["direction"],
                "format": r["format"],
                "inputs": r["inputs"],
                "modules": set(),
                "flops": 0,
            },
        )
        row["modules"].add(r["module"])
        row["flops"] += r["flops"]
    out = sorted(rows.values(), key=lambda r: -r["flops"])
    for row in out:
        row["modules"] = len(row["modules"])
        row["flop_share"] = row["flops"] / total
    return out


_SHORT_DIRECTIONS = {
    FORWARD: "fwd",
    INPUT_GRAD: "dgrad",
    WEIGHT_GRAD: "wgrad",
    RECOMPUTE: "recompute",
}


def show(stage: dict) -> None:
    """The audited step's matmuls by module class and format: the directions that ran so, the
    operands' formats, how many modules, the share of the step's matmul FLOPs."""
    rows: dict[tuple, dict] = {}
    for r in by_class(stage["ops"]):
        key = (r["class"], r["format"], tuple(r["inputs"]))
        row = rows.setdefault(key, {"directions": [], "modules": 0, "share": 0.0})
        row["directions"] += [_SHORT_DIRECTIONS.get(d, d) for d in r["direction"].split("+")]
        row["modules"] = max(row["modules"], r["modules"])
        row["share"] += r["flop_share"]
    if not rows:
        return
    header = ["module", "computed in", "inputs", "directions", "n", "FLOPs"]
    lines = [header] + [
        [
            kind,
            ran,
            "/".join(inputs),
            ",".join(dict.fromkeys(row["directions"])),
            str(row["modules"]),
            f"{row['share']:.1%}",
        ]
        for (kind, ran, inputs), row in sorted(rows.items(), key=lambda kv: -kv[1]["share"])
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    console.say(f"precision manifest: {stage['mode']}, the matmuls of step {stage['step']}")
    for line in lines:
        text = "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True))
        console.console.print(f"  {text.rstrip()}", soft_wrap=True, highlight=False, markup=False)


TABLE_COLUMNS = [
    "stage",
    "module",
    "class",
    "op",
    "direction",
    "format",
    "inputs",
    "calls",
    "flops",
]


def table_rows(manifest: dict) -> list[list]:
    """Every matmul of the manifest, one row each, for a tracker's table."""
    return [
        [
            stage["mode"],
            name,
            entry["class"],
            *(o[k] for k in ("op", "direction", "format")),
            "/".join(o["inputs"]),
            o["calls"],
            o["flops"],
        ]
        for stage in manifest["stages"]
        for name, entry in stage["modules"].items()
        for o in entry["ops"]
    ]


def report(manifest: dict, log) -> None:
    """The plan's mismatches as warnings; the manifest as a table for the tracker (`log`: the
    run's RunLog)."""
    for mismatch in manifest["mismatches"]:
        console.say(f"[yellow]warning:[/] precision manifest: {escape(mismatch)}")
    log.log_table("precision_manifest", TABLE_COLUMNS, table_rows(manifest))
