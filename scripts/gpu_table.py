"""The table scripts/gpu_check.sh prints at its end, in Markdown: each step's result, then one row
per precision of each run: samples/s, speedup, peak memory, MFU, and the step time measured
against the one projected (runner.project):
  python scripts/gpu_table.py --steps STEPS.tsv [--summaries OUT.json.gz] NAME:DIR:MODES...
NAME:DIR:MODES is a sweep folder (one job folder per mode) or a single run's folder, and the
modes it was asked to run: a mode with no finished job still gets its row, saying so. Exits 1
unless every step passed (or did not apply here)."""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from projection_check import projected

HEADER = [
    "run",
    "precision",
    "status",
    "samples/s",
    "speedup",
    "peak memory MB",
    "MFU",
    "measured step",
    "projected step",
    "measured / projected",
    "projected speedup",
]


def summaries(folder: Path) -> list[dict]:
    """The summary.json of a single run's folder, or of each job folder of a sweep."""
    if (folder / "summary.json").exists():
        return [json.loads((folder / "summary.json").read_text())]
    files = sorted(folder.glob("*/summary.json"), key=lambda p: (len(p.parent.name), p.parent.name))
    return [json.loads(f.read_text()) for f in files]


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds else "—"


def rows(name: str, jobs: list[dict], modes: list[str]) -> list[list[str]]:
    """One row per mode asked for; speedups over the run's baseline (fp32 where it ran, else its
    first finished mode), measured per job and projected alike."""
    by_mode = {s.get("precision_requested") or s.get("precision"): s for s in jobs}
    done = [m for m in modes if (by_mode.get(m) or {}).get("status") == "completed"]
    base = by_mode["fp32"] if "fp32" in done else (by_mode[done[0]] if done else {})
    base_projected = projected(base)[1].get("step_time_s") if base else None
    out = []
    for mode in modes:
        s = by_mode.get(mode)
        if s is None:
            out.append([name, mode, "not run"] + ["—"] * (len(HEADER) - 3))
            continue
        status = s.get("status", "?")
        if status != "completed":
            status += f": {str(s.get('error') or '')[:80]}"
        gpu, row = projected(s)
        speed, step, step_projected = (
            s.get("samples_per_s"),
            s.get("step_time_s"),
            row.get("step_time_s"),
        )
        base_speed = base.get("samples_per_s")
        out.append(
            [
                name,
                mode,
                status,
                f"{speed:.1f}" if speed else "—",
                f"{speed / base_speed:.2f}×" if speed and base_speed else "—",
                f"{s['peak_memory_mb']:.0f}" if s.get("peak_memory_mb") else "—",
                f"{s['mfu']:.1%}" if s.get("mfu") is not None else "—",
                _ms(step),
                f"{_ms(step_projected)} ({gpu})" if step_projected else "—",
                f"{step / step_projected:.2f}" if step and step_projected else "—",
                f"{base_projected / step_projected:.2f}×"
                if base_projected and step_projected
                else "—",
            ]
        )
    return out


def markdown(table: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    return lines + ["| " + " | ".join(r) + " |" for r in table[1:]]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=Path, required=True, help="name, result, seconds (TSV)")
    parser.add_argument("--summaries", type=Path, help="every job's summary.json, gzipped")
    parser.add_argument("runs", nargs="*", help="NAME:DIR:MODES")
    args = parser.parse_args(argv)
    steps = [line.split("\t") for line in args.steps.read_text().splitlines() if line]
    failed = [n for n, result, _ in steps if result != "passed" and not result.startswith("skip")]
    table, every, devices = [HEADER], {}, set()
    for spec in args.runs:
        name, folder, modes = spec.split(":")
        jobs = summaries(Path(folder)) if Path(folder).is_dir() else []
        every[name] = jobs
        devices |= {f"{s.get('device_name')} ({s.get('device')})" for s in jobs}
        table += rows(name, jobs, modes.split(","))
    if args.summaries:
        with gzip.open(args.summaries, "wt") as f:
            json.dump(every, f)
    print(f"# GPU check on {', '.join(sorted(devices)) or 'no device (no run finished)'}\n")
    print(
        f"{len(failed)} of {len(steps)} steps did not pass: {', '.join(failed)}\n"
        if failed
        else f"All {len(steps)} steps passed or did not apply here.\n"
    )
    print("\n".join(markdown([["step", "result", "seconds"], *steps])) + "\n")
    print("\n".join(markdown(table)) + "\n")
    print(
        "speedup: samples/s over the run's baseline (fp32 where it ran, else its first mode), "
        "each job timed on its own after its warm-up; projected: runner.project's estimate for "
        "the GPU named, from the audited step, never a measurement."
    )
    if any("(cpu)" in d for d in devices):
        print(
            "\nMeasured on a CPU (the dry run, GPU_CHECK_DRY=1): these figures prove the "
            "plumbing only; a CPU's step says nothing of a GPU's."
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
