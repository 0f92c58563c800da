"""Projected against measured step time, per job of a sweep run with runner.project (issue 33):
`python scripts/projection_check.py SWEEP_DIR`. The GPU is the one each job ran on (its
summary's device_name, as the peak table names it); measured is the job's median step time.
A ratio far from 1.0 says which achievable fraction (runner/measure/projection.py's
ACHIEVABLE) to correct, and by how much. A job that ran on no listed GPU (the CPU dry run of
scripts/gpu_check.sh) is held against the first GPU it was projected on: plumbing, not a check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from runner.measure.peaks import device_model


def projected(summary: dict) -> tuple[str | None, dict]:
    """The GPU a job's step is held against, and the job's projected row there ({} if none)."""
    projection = summary.get("projection") or {}
    gpu = device_model(summary.get("device_name") or "") or next(iter(projection), None)
    return gpu, (projection.get(gpu) or {}).get(summary.get("precision")) or {}


def main(sweep: Path) -> int:
    print("| job | precision | GPU | projected step | measured step | measured / projected |")
    print("|---|---|---|---|---|---|")
    for summary_file in sorted(sweep.glob("*/summary.json"), key=lambda p: p.parent.name):
        s = json.loads(summary_file.read_text())
        gpu, row = projected(s)
        projected_s, measured = row.get("step_time_s"), s.get("step_time_s")
        ratio = f"{measured / projected_s:.2f}" if projected_s and measured else "—"
        shown = [f"{t * 1e3:.3g} ms" if t else "—" for t in (projected_s, measured)]
        print(
            f"| {summary_file.parent.name} | {s.get('precision')} | {gpu} | {shown[0]} | {shown[1]} | {ratio} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
