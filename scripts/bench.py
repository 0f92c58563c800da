"""Benchmarks (they print figures, they assert nothing): four parts.

1. The precision table: the runner's training steps (through `Trainer.fit`, as a run takes them)
   in fp32, tf32, fp16 and bf16 for BERT, ResNet and GPT: samples/s and the speedup over fp32
   (plus peak memory on CUDA).
2. Runner against a bare loop: the runner through `Trainer.fit` against the textbook loop
   (autocast → loss / targets → backward → clip_grad_norm_ → AdamW step → zero_grad) on the same
   model, initial weights and data (both load their batches through the data's loader), fp32
   and bf16; with `--compile`, each side's count of compiled graphs.
3. fp16_master's own gradient averaging over 2 gloo ranks (it is not DDP-wrapped): its buckets
   (one foreach add per micro-batch, one all-reduce per bucket) against one blocking all-reduce
   per gradient tensor and a Python loop of add_, as it was. Each timing is the runner's whole
   fp16_master step (Precision.backward and Precision.step, on the model's batches) with one or
   the other swapped in, and the accumulation and averaging alone on that model's gradients.
4. precision.cpu_kernels on a CPU: the main job's wall time (`python -m runner precision=bf16
   model=bert`, as `make run` runs it), the main job's BERT step in bf16 and fp16 against fp32,
   and `fast` against `native` over 20 steps of BERT, GPT and the UNet in bf16 and fp16: the
   largest relative loss and grad-norm difference of a step, and the loss-scale histories.

Rounds interleave the variants (and alternate their order) so that drift on a shared machine hits
all alike; each timing is `--warmup` untimed steps, then `--steps` timed ones. Figures are
medians over rounds; ratios are medians of per-round ratios (pairs timed back to back). The
runner's side is timed by runner/compare/interleave.py, as the comparison's runner.speed=interleaved is.

    python scripts/bench.py                       # the first two parts, in one process
    python scripts/bench.py --part table --models bert --compile
    python scripts/bench.py --part ratio --steps 50 --rounds 5 model.num_hidden_layers=2
    python scripts/bench.py --part reduce --rounds 5 precision.reduce_dtype=bf16
    python scripts/bench.py --part kernels

Extra positional arguments are Hydra overrides for the runner-against-bare and reduce parts.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

import runner
from runner import console
from runner.compare.interleave import alternate, time_configs
from runner.compare.stats import median_ratio, quartiles
from runner.config.validation import validate
from runner.precision import DeviceCaps, Precision, master, plan, reduce
from runner.precision.caps import resolve_device
from runner.run import build, run, seed_everything
from runner.task import Batch, DataModule, Task
from runner.train.optim import build_optimizers
from runner.train.session import prepared, trainer_timer, workspace
from runner.train.telemetry import compile_counts

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
Timer = Callable[[], float]  # one timing: samples/s


def compose_config(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(runner.CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=OVERRIDES + overrides)
    validate(cfg)
    return cfg


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
    step: Step, data: DataModule, warmup: int, steps: int, device: torch.device
) -> float:
    """The bare loop: runs `warmup` untimed steps, then times `steps` more; its batches come from
    the data's loader as the runner's do, so both sides pay for loading."""
    batches = iter(data.train_loader())

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step(next(batches))
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step(next(batches))
    sync()
    return data.batch_size * steps / (time.perf_counter() - start)


def runner_vs_bare(args) -> None:
    modes = [m for m in args.precisions.split(",") if m in MODES]

    cfg = compose_config([*args.overrides, f"trainer.compile={args.compile}"])
    with ExitStack() as stack:
        device, data, task, log = workspace(cfg, stack)
        timers: dict[tuple[str, str], Timer] = {}
        notes = []
        for mode in modes:
            mode_cfg = OmegaConf.merge(cfg, {"precision": {"mode": mode}})
            runner_task, precision = prepared(mode_cfg, task, device, stack)
            notes.append(precision.describe())
            fit = trainer_timer(
                mode_cfg, runner_task, data, precision, log, args.warmup, args.steps
            )
            bare_task = copy.deepcopy(task).to(device)
            if args.compile:
                bare_task.compile()
            bare = bare_step(bare_task, mode, device, cfg.optim.optimizer.lr)
            timers[mode, "runner"] = lambda fit=fit: fit()["samples_per_s"]
            timers[mode, "bare"] = lambda bare=bare: samples_per_s(
                bare, data, args.warmup, args.steps, device
            )
        # Each side's compiled graphs, counted from an empty cache: two instances of one model
        # class share compiled code, so the second side would otherwise count none. (A warm-up.)
        graphs: dict[tuple[str, str], int] = {}
        for key, timer in timers.items():
            torch._dynamo.reset()
            before = compile_counts()[0]
            timer()
            graphs[key] = compile_counts()[0] - before

        def say(r: int, key: tuple[str, str], rate: float) -> None:
            print(f"round {r + 1}/{args.rounds}  {key[0]:<5} {key[1]:<7} {rate:7.1f} samples/s")

        results = alternate(timers, args.rounds, say)

    def median(a: tuple[str, str], b: tuple[str, str] | None = None) -> float:
        """Median samples/s of `a`, or with `b`, the median of the per-round ratios a/b."""
        return statistics.median(results[a]) if b is None else median_ratio(results[a], results[b])

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
    print(
        f"{'precision':<10} {'runner/s':>9} {'bare/s':>9} {'runner/bare':>12} "
        f"{'quartiles':>14} {'graphs runner':>14} {'graphs bare':>12}"
    )
    for mode in modes:
        run, bare = median((mode, "runner")), median((mode, "bare"))
        ratio = median((mode, "runner"), (mode, "bare"))
        # the per-round ratios' quartiles: the machine's noise, which one median can hide
        rounds = [
            r / b for r, b in zip(results[mode, "runner"], results[mode, "bare"], strict=True)
        ]
        q1, q3 = quartiles(rounds)  # NaN from a single round
        print(
            f"{mode:<10} {run:>9.1f} {bare:>9.1f} {ratio:>12.3f} {f'{q1:.3f}–{q3:.3f}':>14} "
            f"{graphs[mode, 'runner']:>14} {graphs[mode, 'bare']:>12}"
        )
    if set(MODES) <= set(modes):
        speedup = {s: median(("bf16", s), ("fp32", s)) for s in ("runner", "bare")}
        print(f"\nbf16/fp32 speedup: runner {speedup['runner']:.2f}x, bare {speedup['bare']:.2f}x")


TABLE_MODES = ("fp32", "tf32", "fp16", "bf16")
TABLE_MODELS = {
    "bert": OVERRIDES,
    # Small: CPU fp16 convolutions have no fast kernels and run about 100× slower than fp32.
    "resnet": ["model=resnet", "dataset.batch_size=8"],
    "gpt": [
        "model=gpt",
        "model.n_embd=256",
        "model.n_layer=4",
        "model.n_head=4",
        "model.dropout=0",
        "dataset.batch_size=16",
        "dataset.seq_len=128",
    ],
}


def precision_table(args) -> None:
    modes = [m for m in args.precisions.split(",") if m in TABLE_MODES] or list(TABLE_MODES)
    print(f"{'model':<8} {'precision':<10} {'samples/s':>10} {'vs fp32':>8} {'peak MB':>9}")
    for model in args.models.split(","):
        with initialize_config_dir(config_dir=str(runner.CONF_DIR), version_base="1.3"):
            cfg = compose(
                "config", overrides=[*TABLE_MODELS[model], f"trainer.compile={args.compile}"]
            )
        # fp32 first: the speedups are against the first mode.
        order = sorted(modes, key=lambda m: m != "fp32")
        configs = {m: OmegaConf.merge(cfg, {"precision": {"mode": m}}) for m in order}
        figures = time_configs(configs, args.rounds, args.steps, args.warmup)
        cuda = resolve_device(cfg.trainer.device).type == "cuda"
        for mode, f in figures.items():
            vs = f["speedup"] if order[0] == "fp32" else float("nan")
            mem = f"{f['peak_memory_mb']:9.0f}" if cuda else f"{'—':>9}"
            print(f"{model:<8} {mode:<10} {f['samples_per_s']:>10.1f} {vs:>7.2f}× {mem}")
    print(
        f"\n{args.steps} timed steps after {args.warmup} warm-up, medians over {args.rounds} rounds; "
        f"compile={args.compile}; {DeviceCaps.probe(torch.device('cpu')).name}, torch {torch.__version__}\n"
    )


# Many small tensors (74), as a transformer has, and little compute between the collectives (as
# on a GPU): the case where a collective per tensor costs.
REDUCE_OVERRIDES = [
    "model=bert",
    "model.hidden_size=64",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=2",
    "model.intermediate_size=256",
    "model.dropout=0",
    "dataset.batch_size=2",
    "dataset.seq_len=32",
    "dataset.num_documents=400",
    "precision=fp16_master",
    "trainer.accumulate_grad_batches=2",
    "trainer.device=cpu",
]
REDUCE_WORLD = 2


def _accumulate_per_tensor(self: master.MasterWeights) -> None:
    """fp16_master's accumulation as it was: a Python loop of add_ over the tensors."""
    for param, fp32 in self.masters.items():
        if param.grad is None:
            continue
        if fp32.grad is None:
            fp32.grad = param.grad.float()
        else:
            fp32.grad.add_(param.grad)
        param.grad = None


def _average_per_tensor(grads: list[torch.Tensor], world: int, dtype: torch.dtype) -> None:
    """fp16_master's averaging as it was: one blocking all-reduce per tensor (a copy each in bf16)."""
    for grad in grads:
        sent = grad.to(dtype)
        dist.all_reduce(sent)
        if sent is not grad:
            grad.copy_(sent)
    torch._foreach_div_(grads, world)


AVERAGING = {
    "per-tensor": (_accumulate_per_tensor, _average_per_tensor),
    "bucketed": (master.MasterWeights.accumulate, reduce.average_over_ranks),
}


def _reduce_rank(rank: int, port: int, args, results) -> None:
    """One of REDUCE_WORLD gloo ranks: times both averagings in alternating rounds (every rank
    runs the same sequence: the timings are collectives). Rank 0 reports."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=REDUCE_WORLD)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // REDUCE_WORLD))
    with initialize_config_dir(config_dir=str(runner.CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=REDUCE_OVERRIDES + args.overrides)
    validate(cfg)
    device = torch.device("cpu")
    seed_everything(cfg.seed)
    data, task = build(cfg)
    task.to(device)
    precision = Precision(cfg.precision, device, world=REDUCE_WORLD)
    precision.prepare(task, cfg.precision.fp32_modules)
    groups = precision.optimizer_groups(task.parameter_groups())
    optimizers, _ = build_optimizers(cfg.optim, groups, cfg.trainer.max_steps)
    optimizers = list(optimizers.values())
    params = [p for p in task.parameters() if p.requires_grad]
    batches = iter(data.train_loader(0, rank, REDUCE_WORLD))
    micro = cfg.trainer.accumulate_grad_batches

    def step() -> None:
        """The runner's fp16_master step: micro-batches' backward, then the optimizer step."""
        window = [next(batches) for _ in range(micro)]
        norm = sum(task.num_targets(b) for b in window) * REDUCE_WORLD
        for batch in window:
            with precision.autocast():
                loss = task(batch) / norm
            precision.backward([loss])
        precision.step(optimizers, params, cfg.trainer.gradient_clip_val)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)

    # The averaging alone: this model's gradients, fp16 as backward leaves them, accumulated
    # over the window's micro-batches, then averaged over the ranks.
    fp16_grads = [torch.randn_like(p) for p in params]
    fp32 = precision.master.stand_ins(params)
    low = torch.bfloat16 if cfg.precision.reduce_dtype == "bf16" else torch.float32

    def averaging() -> None:
        for _ in range(micro):
            for p, g in zip(params, fp16_grads, strict=True):
                p.grad = g.clone()
            precision.master.accumulate()
        plan.average_over_ranks([p.grad for p in fp32 if p.grad is not None], REDUCE_WORLD, low)
        for p in fp32:
            p.grad = None

    def timer(variant: str, work) -> Callable[[], float]:
        def ms_per_step() -> float:
            master.MasterWeights.accumulate, plan.average_over_ranks = AVERAGING[variant]
            for _ in range(args.warmup):
                work()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                work()
            dist.barrier()
            return (time.perf_counter() - start) / args.steps * 1e3

        return ms_per_step

    timers = {
        (part, v): timer(v, work)
        for part, work in (("step", step), ("averaging", averaging))
        for v in AVERAGING
    }
    figures = alternate(timers, args.rounds)
    if rank == 0:
        results.put(
            {
                "figures": figures,
                "tensors": len(params),
                "params": sum(p.numel() for p in params),
                "micro": micro,
                "reduce_dtype": cfg.precision.reduce_dtype,
                "threads": torch.get_num_threads(),
            }
        )
    dist.destroy_process_group()


def master_reduce(args) -> None:
    context = multiprocessing.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = context.Queue()
    procs = [
        context.Process(target=_reduce_rank, args=(r, port, args, results))
        for r in range(REDUCE_WORLD)
    ]
    for p in procs:
        p.start()
    out = results.get()
    for p in procs:
        p.join()
    figures = out["figures"]
    print(
        f"fp16_master over {REDUCE_WORLD} gloo ranks ({out['threads']} threads each): "
        f"{out['tensors']} gradient tensors, {out['params'] / 1e6:.2f}M params, "
        f"{out['micro']} micro-batches a step, reduce_dtype={out['reduce_dtype']}"
    )
    print(
        f"{args.steps} timed steps after {args.warmup} warm-up per timing; medians over "
        f"{args.rounds} rounds (ratio: median of per-round ratios)\n"
    )
    print(f"{'timing':<11} {'per-tensor ms':>14} {'bucketed ms':>12} {'per-tensor/bucketed':>20}")
    for part in ("step", "averaging"):
        old, new = figures[part, "per-tensor"], figures[part, "bucketed"]
        print(
            f"{part:<11} {statistics.median(old):>14.2f} {statistics.median(new):>12.2f} "
            f"{median_ratio(old, new):>20.2f}"
        )


KERNEL_MODELS = ("bert", "gpt", "unet")  # each at its config's own size
KERNEL_STEPS = 20


def _kernel_runs(model: str, mode: str, root: Path) -> dict[str, tuple[list[dict], float]]:
    """The same 20 steps with precision.cpu_kernels=fast and =native: per kernels, the rows of
    metrics.jsonl and the wall time of the run."""
    out = {}
    for kernels in ("fast", "native"):
        with initialize_config_dir(config_dir=str(runner.CONF_DIR), version_base="1.3"):
            cfg = compose(
                "config",
                overrides=[
                    f"model={model}",
                    f"precision={mode}",
                    f"precision.cpu_kernels={kernels}",
                    f"trainer.max_steps={KERNEL_STEPS}",
                    "trainer.log_every_n_steps=1",
                    "trainer.val_check_interval=0",
                    "trainer.progress_bar=false",
                    "logger=none",
                ],
            )
        folder = root / f"{model}-{mode}-{kernels}"
        start = time.perf_counter()
        quiet = io.StringIO()  # each run's opening lines and summary table
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            run(cfg, folder)
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        out[kernels] = rows, time.perf_counter() - start
    return out


def cpu_kernels(args) -> None:
    """precision.cpu_kernels on this CPU: the main job's wall time as `make run` runs it, the
    main job's BERT step in bf16 and fp16 (auto: fast where the CPU lacks the units) against
    fp32, and fast against native over 20 steps of BERT, GPT and the UNet."""
    caps = DeviceCaps.probe(torch.device("cpu"))
    print(f"{caps.name}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    for mode in ("bf16", "fp16"):
        print(f"  {mode}: {caps.support(mode)[1]}")
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "runner", "precision=bf16", "model=bert"]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=tmp, capture_output=True, text=True)
        took = time.perf_counter() - start
        status = "completed" if done.returncode == 0 else f"failed ({done.returncode})"
        print(f"\nmain job, `python -m runner precision=bf16 model=bert`: {took:.0f} s, {status}")

        with initialize_config_dir(config_dir=str(runner.CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=["model=bert", "trainer.progress_bar=false"])
        configs = {
            m: OmegaConf.merge(cfg, {"precision": {"mode": m}}) for m in ("fp32", "bf16", "fp16")
        }
        figures = time_configs(configs, args.rounds, args.steps, args.warmup)
        print(
            f"\nthe main job's BERT step, {args.steps} timed steps after {args.warmup} warm-up, "
            f"medians over {args.rounds} rounds (cpu_kernels=auto)"
        )
        print(f"{'precision':<10} {'step ms':>8} {'× fp32':>7}")
        for mode, f in figures.items():
            print(f"{mode:<10} {f['step_time_s'] * 1e3:>8.1f} {1 / f['speedup']:>6.2f}×")

        print(f"\nfast against native, {KERNEL_STEPS} steps each (relative differences per step)")
        print(
            f"{'model':<6} {'precision':<10} {'max loss Δ':>11} {'max grad norm Δ':>16} "
            f"{'loss scales':>12} {'fast s':>7} {'native s':>9}"
        )
        for model in KERNEL_MODELS:
            for mode in ("bf16", "fp16"):
                runs = _kernel_runs(model, mode, Path(tmp))
                (fast, fast_s), (native, native_s) = runs["fast"], runs["native"]
                pairs = list(zip(fast, native, strict=True))
                loss = max(abs(f["loss"] / n["loss"] - 1) for f, n in pairs)
                norm = max(abs(f["grad_norm"] / n["grad_norm"] - 1) for f, n in pairs)
                same = [r["loss_scale"] for r in fast] == [r["loss_scale"] for r in native]
                print(
                    f"{model:<6} {mode:<10} {loss:>11.1e} {norm:>16.1e} "
                    f"{'identical' if same else 'DIFFER':>12} {fast_s:>7.1f} {native_s:>9.1f}"
                )


def main() -> None:
    console.quiet_torchao()  # torchao's loader noise, which building the models triggers
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part", choices=("both", "table", "ratio", "reduce", "kernels"), default="both"
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before each timing")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--precisions",
        default="fp32,tf32,fp16,bf16",
        help="the table's modes; runner against bare uses fp32 and bf16 of them",
    )
    parser.add_argument("--models", default="bert,resnet,gpt", help="the table's models")
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile every model (both parts)"
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. dataset.batch_size=32")
    args = parser.parse_args()
    if args.part in ("both", "table"):
        precision_table(args)
    if args.part in ("both", "ratio"):
        runner_vs_bare(args)
    if args.part == "reduce":
        master_reduce(args)
    if args.part == "kernels":
        cpu_kernels(args)


if __name__ == "__main__":
    main()
