"""Benchmarks (they print figures, they assert nothing): four parts.

1. The precision table: the runner's training steps (through `Trainer.fit`, as a run takes them)
   in fp32, tf32, fp16 and bf16 for BERT, ResNet and GPT: samples/s and the speedup over fp32
   (plus peak memory on CUDA).
2. Runner against a bare loop, two ways, fp32 and bf16, each said for what it is. Steady steps
   in one process: the runner through `Trainer.fit` against the textbook loop (autocast → loss /
   targets → backward → clip_grad_norm_ → AdamW step → zero_grad) on the same model, initial
   weights and data (both load their batches through the data's loader); with `--compile`, each
   side's count of compiled graphs. Whole runs: `python -m runner` against a bare script, each
   as a process of its own, at two lengths (`--lengths`), whose difference cancels each side's
   fixed costs (imports, building, the audited step, the last checkpoint) and leaves the steps
   with what each pays per step (the runner's logging included; no evaluation on either side).
   Every timing records what it got of the machine (runner/measure/contention.py); a contended
   round is timed again, and one that stays contended is counted in the table.
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
medians over rounds; ratios are per-round ratios (pairs timed back to back) in a geometric
mean that weights each order alike (runner/compare/stats.py's round_ratio). The
runner's side is timed by runner/compare/interleave.py, as the comparison's runner.speed=interleaved is.

    python scripts/bench.py                       # the first two parts, in one process
    python scripts/bench.py --part table --models bert --compile
    python scripts/bench.py --part ratio --steps 50 --rounds 5 model.num_hidden_layers=2
    python scripts/bench.py --part runs --lengths 20,120 --rounds 3
    python scripts/bench.py --part reduce --rounds 5 precision.reduce_dtype=bf16
    python scripts/bench.py --part kernels

Extra positional arguments are Hydra overrides for the runner-against-bare and reduce parts.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import json
import multiprocessing
import os
import shutil
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
from runner.compare.interleave import alternate, clean_rounds, time_configs
from runner.compare.stats import quartiles, round_ratio
from runner.config.validation import validate
from runner.measure.contention import Window
from runner.precision import DeviceCaps, Precision, master, plan, reduce
from runner.precision.caps import resolve_device
from runner.run import build, run, seed_everything
from runner.task import Batch, DataModule, Task
from runner.train.optim import build_optimizers
from runner.train.session import prepared, trainer_timer, workspace
from runner.train.telemetry import compile_counts
from runner.train.threads import Threads

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
Timer = Callable[[], dict]  # one timing: samples_per_s, speed_contended, cpu_share


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
) -> dict:
    """The bare loop: runs `warmup` untimed steps, then times `steps` more; its batches come from
    the data's loader as the runner's do, so both sides pay for loading. Returns samples_per_s
    and what the timing got of the machine (`speed_contended`, `cpu_share`)."""
    batches = iter(data.train_loader())

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step(next(batches))
    sync()
    start, window = time.perf_counter(), Window(device)
    for _ in range(steps):
        step(next(batches))
    sync()
    rate, got = data.batch_size * steps / (time.perf_counter() - start), window.read()
    return {"samples_per_s": rate, "speed_contended": got["contended"], **_share(got)}


def _share(got: dict) -> dict:
    return {"cpu_share": got.get("cpu_share")}


def _runner_timing(summary: dict) -> dict:
    """A `Trainer.fit` timing's summary as the bare loop's: its speed and what it got."""
    share = _share(summary.get("contention") or {})
    return {"samples_per_s": summary["samples_per_s"], **share} | {
        "speed_contended": summary["speed_contended"]
    }


def _bare_run(args) -> None:
    """A whole bare run, as a process of its own (`--bare-run N`): the imports, the model and
    data built as a run builds them, N steps of the bare loop; prints its speed as JSON."""
    mode = args.precisions
    cfg = compose_config(args.overrides)
    torch.set_num_threads(cfg.trainer.cpu_threads or torch.get_num_threads())
    device = resolve_device(cfg.trainer.device)
    seed_everything(cfg.seed)
    data, task = build(cfg)
    task.to(device)
    print(
        json.dumps(
            samples_per_s(bare_step(task, mode, device, 1e-4), data, 0, args.bare_run, device)
        )
    )


def _whole_run(side: str, mode: str, steps: int, args, folder: Path) -> dict:
    """One whole run in a process of its own: its wall time, and whether it was contended."""
    threads = f"trainer.cpu_threads={torch.get_num_threads()}"  # the same on both sides
    overrides = [*OVERRIDES, *args.overrides, threads, f"trainer.max_steps={steps}"]
    if side == "runner":
        overrides += ["trainer.val_check_interval=0", "trainer.progress_bar=false", "logger=none"]
        command = [sys.executable, "-m", "runner", f"precision={mode}", *overrides]
        command.append(f"hydra.run.dir={folder}")
    else:
        command = [sys.executable, __file__, "--bare-run", str(steps), "--precisions", mode]
        command += [*args.overrides, threads, f"trainer.max_steps={steps}"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=folder.parent)
    took = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{side} {mode} {steps} steps failed: {done.stderr[-2000:]}")
    if side == "runner":
        got = json.loads((folder / "summary.json").read_text())
        shutil.rmtree(folder)
    else:
        got = json.loads(done.stdout.splitlines()[-1])
    said = " (contended)" if got["speed_contended"] else ""
    print(f"{side:<6} {mode:<5} {steps:>4} steps: {took:6.1f} s{said}", flush=True)
    return {"wall_s": took, "speed_contended": got["speed_contended"]}


def whole_runs(args) -> None:
    """The runner against the bare loop by whole runs of two lengths (`_whole_run`), alternated
    round by round: per step, the difference of the two lengths' wall times over their steps."""
    modes = [m for m in args.precisions.split(",") if m in MODES]
    short, long = sorted(int(n) for n in args.lengths.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        timers = {
            (mode, side, n): functools.partial(
                _whole_run, side, mode, n, args, Path(tmp) / f"{mode}-{side}-{n}"
            )
            for mode in modes
            for side in ("runner", "bare")
            for n in (short, long)
        }
        timings, redone = clean_rounds(timers, args.rounds)
    contended = sum(
        any(v[r]["speed_contended"] for v in timings.values()) for r in range(args.rounds)
    )
    print(
        f"\nwhole runs, each a process of its own (`python -m runner`, no evaluation, against a "
        f"bare script): {short} and {long} steps; per step: the difference of their wall times "
        f"over {long - short} steps, the fixed costs cancelled; medians over {args.rounds} "
        f"rounds; {redone} contended rounds timed again, {contended} still contended\n"
    )
    print(
        f"{'precision':<10} {'runner ms/step':>15} {'bare ms/step':>13} {'runner/bare':>12} "
        f"{'runner fixed s':>15} {'bare fixed s':>13}"
    )
    for mode in modes:
        per_step, fixed = {}, {}
        for side in ("runner", "bare"):
            walls = [
                (a["wall_s"], b["wall_s"])
                for a, b in zip(timings[mode, side, short], timings[mode, side, long], strict=True)
            ]
            per_step[side] = [(b - a) / (long - short) for a, b in walls]
            fixed[side] = statistics.median(
                a - short * t for (a, _), t in zip(walls, per_step[side], strict=True)
            )
        ratio = round_ratio([1 / t for t in per_step["runner"]], [1 / t for t in per_step["bare"]])
        print(
            f"{mode:<10} {statistics.median(per_step['runner']) * 1e3:>15.1f} "
            f"{statistics.median(per_step['bare']) * 1e3:>13.1f} {ratio:>12.3f} "
            f"{fixed['runner']:>15.1f} {fixed['bare']:>13.1f}"
        )


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
            timers[mode, "runner"] = lambda fit=fit: _runner_timing(fit())
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

        timings, redone = clean_rounds(timers, args.rounds)
    results = {k: [t["samples_per_s"] for t in v] for k, v in timings.items()}
    contended = sum(
        any(v[r]["speed_contended"] for v in timings.values()) for r in range(args.rounds)
    )

    def median(a: tuple[str, str], b: tuple[str, str] | None = None) -> float:
        """Median samples/s of `a`, or with `b`, the ratio a/b over the rounds (round_ratio)."""
        return statistics.median(results[a]) if b is None else round_ratio(results[a], results[b])

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
        f"steady steps in one process: {args.steps} timed steps after {args.warmup} warm-up per "
        f"timing; medians over {args.rounds} rounds (ratios: per-round ratios, each order "
        f"weighted alike); {redone} contended rounds timed again, {contended} still contended\n"
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
        f"{args.rounds} rounds (ratio: per-round ratios, each order weighted alike)\n"
    )
    print(f"{'timing':<11} {'per-tensor ms':>14} {'bucketed ms':>12} {'per-tensor/bucketed':>20}")
    for part in ("step", "averaging"):
        old, new = figures[part, "per-tensor"], figures[part, "bucketed"]
        print(
            f"{part:<11} {statistics.median(old):>14.2f} {statistics.median(new):>12.2f} "
            f"{round_ratio(old, new):>20.2f}"
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
        "--part",
        choices=("both", "table", "ratio", "steps", "runs", "reduce", "kernels"),
        default="both",
        help="ratio: the runner against the bare loop both ways (steps: in one process; runs: "
        "whole runs of two lengths)",
    )
    parser.add_argument("--lengths", default="20,120", help="the whole runs' two lengths")
    parser.add_argument("--threads", type=int, help="torch's threads (default: the free cores)")
    parser.add_argument("--bare-run", type=int, help=argparse.SUPPRESS)  # one whole bare run
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
    if args.bare_run:
        return _bare_run(args)
    # Threads that fit the cores other processes leave free, as a run takes them: on a shared
    # machine, 2 threads with one core taken run many times slower than 1 (docs/performance.md)
    Threads().fit(args.threads, torch.device("cpu"))
    print(f"{torch.get_num_threads()} threads", flush=True)
    if args.part in ("both", "table"):
        precision_table(args)
    if args.part in ("both", "ratio", "steps"):
        runner_vs_bare(args)
    if args.part in ("both", "ratio", "runs"):
        whole_runs(args)
    if args.part == "reduce":
        master_reduce(args)
    if args.part == "kernels":
        cpu_kernels(args)


if __name__ == "__main__":
    main()
