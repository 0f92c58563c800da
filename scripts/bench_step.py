"""How much does the runner's training step cost over a bare PyTorch AMP loop?

Times `Trainer.train_step([batch])` against the textbook loop (autocast → loss / targets →
backward → clip_grad_norm_ → AdamW step → zero_grad) on the same model, the same initial
weights and the same batches, for fp32 and bf16. Rounds interleave the two sides (and swap
their order each round) so that thermal or background drift hits both alike; each timing is
`--warmup` untimed steps, then `--steps` timed ones. The table shows median samples/s over
rounds, and each ratio as the median of its per-round ratios (pairs timed back to back). It
prints numbers and asserts nothing.

    python scripts/bench_step.py
    python scripts/bench_step.py --steps 50 --rounds 5 model.num_hidden_layers=2

Extra positional arguments are Hydra overrides, applied after the defaults below.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

import runner
from runner.config import validate
from runner.optim import build_optimizers
from runner.precision import DeviceCaps, Precision
from runner.run import build, resolve_device, seed_everything
from runner.task import Batch, DataModule, Task
from runner.tracking import RunLog
from runner.trainer import Trainer

OVERRIDES = [
    "model=bert",
    "model.hidden_size=256",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=4",
    "model.intermediate_size=1024",
    "model.dropout=0",
    "dataset.batch_size=16",
    "dataset.seq_len=128",
]
MODES = ("fp32", "bf16")  # the bare loop has no GradScaler, and tf32 is a global switch

Step = Callable[[Batch], object]


def compose_config(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(runner.CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=OVERRIDES + overrides)
    validate(cfg)
    return cfg


def runner_step(
    cfg: DictConfig, task: Task, data: DataModule, precision: Precision, log: RunLog
) -> Step:
    """A Trainer wired as `runner.run.run` wires it."""
    optimizers, schedulers = build_optimizers(cfg.optim, task, cfg.trainer.max_steps)
    trainer = Trainer(
        cfg.trainer, task, data, precision, optimizers, schedulers, log, precision.device
    )
    return lambda batch: trainer.train_step([batch])


def bare_step(task: Task, mode: str, device: torch.device, lr: float) -> Step:
    params = [p for p in task.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)

    def step(batch: Batch) -> None:
        num_targets = task.num_targets(batch)
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = task(batch) / num_targets
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def samples_per_s(
    step: Step, batches: list[Batch], warmup: int, batch_size: int, device: torch.device
) -> float:
    """Runs `warmup` untimed steps, then times the rest of `batches`."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for batch in batches[:warmup]:
        step(batch)
    sync()
    start = time.perf_counter()
    for batch in batches[warmup:]:
        step(batch)
    sync()
    return batch_size * len(batches[warmup:]) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before each timing")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precisions", default=",".join(MODES), help="comma-separated: fp32,bf16")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. dataset.batch_size=32")
    args = parser.parse_args()
    modes = args.precisions.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"--precisions: {unknown} not in {MODES}")

    cfg = compose_config(args.overrides)
    device = resolve_device(cfg.trainer.device)
    seed_everything(cfg.seed)
    data, task = build(cfg)
    loader = iter(data.train_loader())
    batches = [next(loader) for _ in range(args.warmup + args.steps)]

    results: dict[tuple[str, str], list[float]] = {}
    with ExitStack() as stack:
        log = RunLog(Path(stack.enter_context(tempfile.TemporaryDirectory())))
        stack.callback(log.close)
        steps: dict[str, dict[str, Step]] = {}
        notes = []
        for mode in modes:
            precision = Precision(OmegaConf.merge(cfg.precision, {"mode": mode}), device)
            stack.callback(precision.close)  # closed in reverse order: the first restores last
            notes.append(precision.describe())
            runner_task, bare_task = copy.deepcopy(task).to(device), copy.deepcopy(task).to(device)
            steps[mode] = {
                "runner": runner_step(cfg, runner_task, data, precision, log),
                "bare": bare_step(bare_task, mode, device, cfg.optim.optimizer.lr),
            }
        for r in range(args.rounds):
            for mode in modes:
                sides = ("runner", "bare") if r % 2 == 0 else ("bare", "runner")
                for side in sides:
                    rate = samples_per_s(
                        steps[mode][side], batches, args.warmup, data.batch_size, device
                    )
                    results.setdefault((mode, side), []).append(rate)
                    print(f"round {r + 1}/{args.rounds}  {mode:<5} {side:<7} {rate:7.1f} samples/s")

    def median(a: tuple[str, str], b: tuple[str, str] | None = None) -> float:
        """Median samples/s of `a`, or with `b`, the median of the per-round ratios a/b: pairs
        timed back to back, so drift between rounds cancels out."""
        if b is None:
            return statistics.median(results[a])
        return statistics.median(x / y for x, y in zip(results[a], results[b], strict=True))

    params = sum(p.numel() for p in task.parameters())
    shape = ", ".join(f"{k}={v}" for k, v in cfg.model.items() if k != "_target_")
    print()
    print(
        f"machine: {DeviceCaps.probe(torch.device('cpu')).name} | device {device} | "
        f"torch {torch.__version__} | {torch.get_num_threads()} threads"
    )
    print(f"model: {type(task).__name__}, {params / 1e6:.1f}M params ({shape})")
    print(f"data: {', '.join(f'{k}={v}' for k, v in data.describe().items())}")
    print(f"precision: {'; '.join(notes)}")
    print(
        f"{args.steps} timed steps after {args.warmup} warm-up per timing; medians over "
        f"{args.rounds} rounds (ratios: median of per-round ratios)\n"
    )
    print(f"{'precision':<10} {'runner/s':>9} {'bare/s':>9} {'runner/bare':>12}")
    for mode in modes:
        run, bare = median((mode, "runner")), median((mode, "bare"))
        ratio = median((mode, "runner"), (mode, "bare"))
        print(f"{mode:<10} {run:>9.1f} {bare:>9.1f} {ratio:>12.3f}")
    if set(MODES) <= set(modes):
        speedup = {s: median(("bf16", s), ("fp32", s)) for s in ("runner", "bare")}
        print(f"\nbf16/fp32 speedup: runner {speedup['runner']:.2f}x, bare {speedup['bare']:.2f}x")


if __name__ == "__main__":
    main()
