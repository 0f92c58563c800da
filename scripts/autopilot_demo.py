"""The emerging-outlier run side by side (README's figure; it measures, it asserts nothing): a net
in which, from step 40, one input channel of one Linear holds 1e6 that its weights never read
(tests/autopilot_nets.py's ActivationOutlier), trained in bf16, in fp8 as configured, and in fp8
with precision.autopilot. Prints each run's eval loss, gap to bf16, switches and share of FLOPs
in fp8, and writes the three loss curves with the switch step marked.

    python scripts/autopilot_demo.py                       # docs/img/autopilot_outlier.png
    python scripts/autopilot_demo.py --steps 200 --out /tmp/outlier.png"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from runner.summary_aliases import converted_share  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RUNS = {
    "bf16": ["precision=bf16"],
    "fp8": ["precision=fp8"],
    "fp8 + autopilot": ["precision=fp8", "precision.autopilot=true"],
}


def run(name: str, steps: int, every: int, root: Path) -> Path:
    out = root / name.replace(" ", "").replace("+", "_")
    cmd = [sys.executable, "-m", "runner", *RUNS[name], "model=module", "dataset=blobs"]
    cmd += ["model.net._target_=tests.autopilot_nets.ActivationOutlier"]
    cmd += [f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}"]
    cmd += [f"precision.autopilot.every_n_steps={every}", "trainer.log_every_n_steps=10"]
    cmd += ["logger=none", "trainer.progress_bar=false", f"hydra.run.dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    subprocess.run(cmd, check=True, env=env, cwd=root, capture_output=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--out", default=str(REPO / "docs" / "img" / "autopilot_outlier.png"))
    args = parser.parse_args()
    fig, ax = plt.subplots(figsize=(7, 4))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in RUNS:
            out = run(name, args.steps, args.every, Path(tmp))
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=name, lw=1)
            results[name] = json.loads((out / "summary.json").read_text())
            if name.endswith("autopilot"):
                results["recipe"] = (out / "autopilot_recipe.yaml").read_text()
    pilot = results["fp8 + autopilot"]["autopilot"]
    for step in sorted({s["step"] for s in pilot["switches"]}):
        ax.axvline(step, color="grey", ls=":", lw=1)
        ax.annotate(f"switch at step {step}", (step, ax.get_ylim()[1]), fontsize=8, va="top")
    ax.set(xlabel="step", ylabel="training loss", title="an outlier emerges at step 40")
    ax.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    bf16 = results["bf16"]["eval_loss"]
    print("| run | eval loss | gap to bf16 | FLOPs in fp8 | switches |\n|---|---|---|---|---|")
    for name in RUNS:
        s = results[name]
        share = converted_share(s)
        switches = "; ".join(
            f"step {w['step']}: {w['module']} {w['directions']} ({w['measured']})"
            for w in (s.get("autopilot") or {}).get("switches", [])
        )
        cell = f"{share:.0%}" if share is not None else "—"
        print(
            f"| {name} | {s['eval_loss']:.4f} | {s['eval_loss'] / bf16 - 1:+.1%} | {cell} "
            f"| {switches or '—'} |"
        )
    print(f"\nthe recipe written:\n{results['recipe']}\nplot: {args.out}")


if __name__ == "__main__":
    main()
