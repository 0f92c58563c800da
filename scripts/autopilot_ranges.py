"""The clean ranges precision.autopilot's defaults come from (it measures, it asserts nothing):
runs of a clean model in each converting mode over several seeds, each matmul's error measured
every `--every` steps (precision.error_every_n_steps), and per format and direction the lowest
SQNR, the largest share of an operand flushed to zero, and the largest fall of a unit's SQNR
below the median of its own earlier measurements. The autopilot's defaults sit below (above, for
the flushed share) what these clean runs reach (docs/precision-modes.md#autopilot).

    python scripts/autopilot_ranges.py                  # tiny GPT, fp8 mxfp8 nvfp4 mxfp4, 3 seeds
    python scripts/autopilot_ranges.py --modes fp8 --seeds 0,1 --steps 200 model.n_layer=4

Extra positional arguments are Hydra overrides for every run."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

MODEL = [
    "model=gpt",
    "model.n_embd=64",
    "model.n_layer=2",
    "model.dropout=0",
    "dataset.seq_len=32",
    "dataset.batch_size=8",
    "dataset.num_documents=200",
]


def run(mode: str, seed: int, steps: int, every: int, extra: list[str], root: Path) -> list[dict]:
    out = root / f"{mode}-{seed}"
    cmd = [sys.executable, "-m", "runner", f"precision={mode}", f"seed={seed}", *MODEL]
    cmd += [f"trainer.max_steps={steps}", f"precision.error_every_n_steps={every}"]
    cmd += ["logger=none", "trainer.progress_bar=false", "runner.summary=short"]
    cmd += [*extra, f"hydra.run.dir={out}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    subprocess.run(cmd, check=True, env=env, cwd=root, capture_output=True)
    return json.loads((out / "summary.json").read_text())["matmul_error"]


def ranges(records: list[dict]) -> dict[tuple[str, str], dict]:
    """Per (format, direction): the lowest SQNR, the largest flushed share, the largest fall
    below the unit's own earlier median."""
    out: dict[tuple[str, str], dict] = defaultdict(
        lambda: {"min_sqnr": float("inf"), "max_flushed": 0.0, "max_fall": 0.0, "n": 0}
    )
    seen: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in sorted(records, key=lambda r: r["step"]):
        if r["format"] in ("bf16", "fp32") or not isinstance(r["sqnr_db"], int | float):
            continue
        key, unit = (r["format"], r["direction"]), (r["module"], r["direction"])
        o = out[key]
        o["n"] += 1
        o["min_sqnr"] = min(o["min_sqnr"], r["sqnr_db"])
        o["max_flushed"] = max(
            [o["max_flushed"]] + [v["underflow"] for v in r["operands"].values()]
        )
        if seen[unit]:
            o["max_fall"] = max(o["max_fall"], statistics.median(seen[unit]) - r["sqnr_db"])
        seen[unit].append(r["sqnr_db"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="fp8,mxfp8,nvfp4,mxfp4")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10)
    args, extra = parser.parse_known_args()
    print(f"CPU: {cpu_model()}; model: {' '.join(MODEL + extra)}; {args.steps} steps")
    print(f"{'format':8} {'direction':11} {'n':>4} {'min SQNR':>9} {'max flushed':>12} {'max fall':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            records = []
            for seed in (int(s) for s in args.seeds.split(",")):
                for r in run(mode, seed, args.steps, args.every, extra, Path(tmp)):
                    records.append(r | {"module": f"{seed}:{r['module']}"})
            for (fmt, direction), o in sorted(ranges(records).items()):
                print(
                    f"{fmt:8} {direction:11} {o['n']:4d} {o['min_sqnr']:8.1f}  "
                    f"{o['max_flushed']:11.2%} {o['max_fall']:8.1f}"
                )


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
