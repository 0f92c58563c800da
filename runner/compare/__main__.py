"""`python -m runner.compare SWEEP_DIR`: the comparison of a finished sweep (runner/compare/sweep.py),
with the tolerance, the speed's source and the target of the command line."""

from __future__ import annotations

import sys
from pathlib import Path

from runner.compare.sweep import TOLERANCE, compare
from runner.errors import UserError


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m runner.compare",
        description="the precisions of a sweep side by side, with a verdict",
    )
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument(
        "--tolerance",
        type=float,
        help="loss gap vs fp32 still counted as equal (default: the sweep's compare.tolerance, "
        f"else {TOLERANCE})",
    )
    parser.add_argument("--no-wandb", action="store_true", help="do not log the comparison to W&B")
    parser.add_argument(
        "--speed",
        choices=("jobs", "interleaved"),
        help="each job's own speed, or the precisions timed again side by side in this process "
        "(default: as the sweep's runner.speed says)",
    )
    parser.add_argument(
        "--target",
        type=float,
        help="the value of --target-metric each row is timed to (default: the sweep's "
        "compare.target, else the baseline's final eval loss +tolerance)",
    )
    parser.add_argument(
        "--target-metric", help="the evaluation metric of the target (default: eval_loss)"
    )
    parser.add_argument(
        "--target-direction",
        choices=("lower", "higher"),
        help="which way is better (default: lower for a loss or error, higher for the rest)",
    )
    args = parser.parse_args(argv)
    if args.target_metric is not None and not args.target_metric.startswith("eval_"):
        print("error: --target-metric: an evaluation metric (eval_loss, ...)", file=sys.stderr)
        sys.exit(2)
    given = {
        "target": args.target,
        "target_metric": args.target_metric,
        "target_direction": args.target_direction,
    }
    try:
        compare(
            args.sweep_dir,
            args.tolerance,
            wandb_log=not args.no_wandb,
            speed=args.speed,
            target=given,
        )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
