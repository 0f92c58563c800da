"""Measurements of a run: step timing by logging interval, throughput statistics, peak memory,
compile counts, and when to audit a step (runner/measure/flops.py has the FLOPs, MFU and the audit)."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable

import torch

from runner import console
from runner.measure.flops import PrecisionAudit
from runner.measure.manifest_table import show as show_manifest
from runner.measure.matmuls import MatmulLog
from runner.measure.memory import SavedActivations, peak_memory_mb, peak_reserved_mb
from runner.measure.module_stack import ModuleStack
from runner.task import Batch

INPUT_BOUND_SHARE = 0.2  # above this share of step time spent waiting for data, warn


def compile_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process: Dynamo's own counters."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def read_later(value: torch.Tensor) -> Callable[[], float]:
    """Starts copying a device flag to the host and returns its reader, which waits for that copy
    only, not for the work queued after it. On the CPU there is nothing to wait for."""
    if value.device.type != "cuda":
        return value.item
    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    host.copy_(value, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> float:
        copied.synchronize()
        return host.item()

    return read


def _iqr(values: list[float]) -> float:
    """The interquartile range (linear interpolation between the values, as numpy's default)."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


def batch_samples(window: list[Batch]) -> int:
    return sum(len(next(iter(b.values()))) for b in window)


class Meter:
    """A run's measurements. Each step's device values (losses, grad norm, loss scale, skip flag)
    wait on the device until a flush reads the whole interval in one transfer, the only sync;
    each step of an interval gets the interval's mean step time, exact on any device. The speed
    figures leave out the warm-up; the first step of each precision stage is audited."""

    def __init__(
        self,
        cfg,
        device: torch.device,
        world: int,
        rows: list[dict],
        num_tokens: Callable[[Batch], int],
        task: torch.nn.Module | None = None,
    ):
        self.cfg, self.device, self.world, self.num_tokens = cfg, device, world, num_tokens
        self.rows = rows  # every row logged (a resumed run starts with the earlier ones)
        self.audit: dict | None = None  # the precision audit of the last stage's first step
        self.task = task
        # the precision manifest's record of each stage's audited step: {mode, step, ops}, and
        # `traffic` (each matmul by shape, other ops' bytes) for the projection
        self.audited_steps: list[dict] = []
        self.activations = SavedActivations(task)  # counted in audited steps
        self.health: dict | None = None  # fp16's gradient health, from an audited step
        self._auditing = False
        self._pending: list[dict] = []

    def start(self, step: int) -> None:
        self.first_step = step
        cfg = self.cfg  # the schedule `due` reads every step, as plain values
        every = cfg.val_check_interval if cfg.limit_val_batches else 0  # 0 batches: no evaluation
        self._schedule = (
            cfg.max_steps,
            step + cfg.benchmark.warmup_steps,
            cfg.log_every_n_steps,
            every,
            cfg.checkpoint_every_n_steps,
        )
        self._steady_after = step + cfg.benchmark.warmup_steps  # this attempt's warm-up
        self.started = self.interval_start = time.perf_counter()
        self._compiled_before = compile_counts()  # a multirun's earlier jobs compiled too

    def fetch(self, loader, n: int) -> tuple[list[Batch], float]:
        """The next `n` micro-batches and the host time spent waiting for them."""
        start = time.perf_counter()
        window = [next(loader) for _ in range(n)]
        return window, time.perf_counter() - start

    def restage(self) -> None:
        """A new precision stage: audit its first step (the summary has the last stage's)."""
        self.audit = None

    @contextlib.contextmanager
    def audited(
        self,
        probe: Callable[[], dict | None] = lambda: None,
        counting: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        mode: str = "",
        step: int = 0,
    ):
        """Records the step op by op, where no audit exists yet: which dtype each op ran in, what
        its forwards save for backward, and each matmul by module and direction (the precision
        manifest, printed here); `probe` measures before it (fp16 health), and `counting` adds its
        own figures (the converted GEMMs'). `mode`, `step`: the mode in force and the step audited.
        Eagerly: Dynamo skips for good a frame it meets under a dispatch mode."""
        if self.audit is not None:
            yield
            return
        stack = ModuleStack(self.task) if self.task is not None else None
        matmuls = MatmulLog(stack) if stack is not None else None
        with torch.compiler.set_stance("force_eager"):
            self.health = probe() or self.health
            self._auditing = True
            try:
                with (
                    stack or contextlib.nullcontext(),
                    PrecisionAudit(matmuls) as audit,
                    counting() as counted,
                ):
                    yield
            finally:
                self._auditing = False
        self.audit = audit.report() | (counted or {})
        if matmuls is not None:
            self.audited_steps.append(
                {"mode": mode, "step": step, "ops": matmuls.records(), "traffic": matmuls.traffic()}
            )
            show_manifest(self.audited_steps[-1])

    def saving(self) -> contextlib.AbstractContextManager:
        """Around a forward: in an audited step, counts the activations it saves for backward."""
        return self.activations.counting() if self._auditing else contextlib.nullcontext()

    def record(self, step, losses, result, window, data_wait, lr, mode: str) -> int:
        """Buffers a step's values (left on the device); returns its samples over all ranks."""
        samples = batch_samples(window) * self.world
        self._pending.append(
            {
                "step": step,
                "device_values": losses
                | {
                    "grad_norm": result.grad_norm,
                    "loss_scale": result.loss_scale,
                    "skipped": result.skipped,
                },
                "lr": lr,
                "precision": mode,
                "data_wait_s": data_wait,
                "samples": samples,
                "tokens": sum(self.num_tokens(b) for b in window) * self.world,
            }
        )
        return samples

    def due(self, step: int) -> dict[str, bool]:
        """What the end of `step` calls for: the same on every rank."""
        max_steps, warmup_end, log_every, eval_every, checkpoint_every = self._schedule
        last = step == max_steps
        # The warm-up ends on an interval boundary, so steady timings start clean.
        return {
            "log": step % log_every == 0 or last or step == warmup_end,
            "eval": eval_every > 0 and (step % eval_every == 0 or last),
            "checkpoint": checkpoint_every > 0 and step % checkpoint_every == 0,
            "last": last,
        }

    def flush(self, skipped_total: int) -> list[dict]:
        """The interval's rows: its device values read in one transfer, then timed. Every step up
        to here is settled: `skipped_total` counts them all."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        keys = list(pending[0]["device_values"])
        values = torch.stack([torch.stack([r["device_values"][k] for k in keys]) for r in pending])
        values = values.tolist()
        step_time = (time.perf_counter() - self.interval_start) / len(pending)
        memory = peak_memory_mb(self.device)
        skipped_total -= sum(v[keys.index("skipped")] > 0 for v in values)
        rows = []
        for r, row_values in zip(pending, values, strict=True):
            row = {"step": r["step"], **dict(zip(keys, row_values, strict=True))}
            row["skipped"] = row["skipped"] > 0
            skipped_total += row["skipped"]
            rows.append(
                row
                | {"skipped_total": skipped_total, "lr": r["lr"], "precision": r["precision"]}
                | {
                    "data_wait_s": r["data_wait_s"],
                    "step_time_s": step_time,
                    "samples_per_s": r["samples"] / step_time,
                    "tokens_per_s": r["tokens"] / step_time,
                    "peak_memory_mb": memory,
                    # past this attempt's warm-up: in the speed figures, a resumed run's too
                    "steady": r["step"] > self._steady_after,
                }
            )
        self.rows += rows
        return rows

    def lap(self) -> None:
        """The next interval starts now: evaluation and checkpoints are not step time."""
        self.interval_start = time.perf_counter()

    def speed(self) -> dict:
        """The steady window's speed (`steady_speed`): every attempt's steps after its warm-up
        (a resumed run's earlier ones are in metrics.jsonl)."""
        return steady_speed(self.rows, self.cfg.benchmark.warmup_steps)

    def summary(self) -> dict:
        """The run's last values, its last and best evaluation, speed, memory and compile counts,
        and the precision audit. A rank other than 0 that resumed a finished run has no rows:
        its last values are None."""
        graphs, breaks = compile_counts()
        evals = [r for r in self.rows if "eval_loss" in r]
        last = self.rows[-1] if self.rows else {}
        return {
            "final_loss": last.get("loss"),
            "final_grad_norm": last.get("grad_norm"),
            **({k: v for k, v in evals[-1].items() if k.startswith("eval_")} if evals else {}),
            **({"best_eval_loss": min(r["eval_loss"] for r in evals)} if evals else {}),
            **self.speed(),
            "peak_memory_mb": peak_memory_mb(self.device),
            "peak_reserved_mb": peak_reserved_mb(self.device),
            "wall_time_s": time.perf_counter() - self.started,
            "compiled_graphs": graphs - self._compiled_before[0],
            "graph_breaks": breaks - self._compiled_before[1],
            **(self.audit or {}),
        }


def steady_speed(rows: list[dict], warmup: int) -> dict:
    """Median throughput, median and p90 step time, and the share of step time spent waiting
    for data, over the steady window: the rows past their attempt's warm-up (`steady`; rows
    written before that flag, past the run's first `warmup` steps). The spread: the
    interquartile ranges of throughput and step time over the window's steps, which are timed
    by interval; None where the window has fewer than two intervals to compare."""
    steady = [r for r in rows if r.get("steady", r["step"] > warmup)]
    if not steady:
        # The warm-up holds the eager audit and fp16's fp32 probe: its speed would mislead.
        keys = ("samples_per_s", "samples_per_s_iqr", "tokens_per_s", "step_time_s")
        keys += ("step_time_s_iqr", "step_time_p90_s", "data_wait_share")
        return dict.fromkeys(keys) | {
            "speed_intervals": 0,
            "speed_note": f"no steady window: the run ended within its {warmup}-step warm-up "
            "(trainer.benchmark.warmup_steps), so its speed is untested",
        }
    times = [r["step_time_s"] for r in steady]
    # An interval's steps share its mean time: a new time, or a gap in the steps, starts one.
    intervals = 1 + sum(
        a["step_time_s"] != b["step_time_s"] or b["step"] != a["step"] + 1
        for a, b in zip(steady, steady[1:], strict=False)
    )
    throughput = [r["samples_per_s"] for r in steady]
    wait_share = sum(r["data_wait_s"] for r in steady) / max(sum(times), 1e-12)
    if wait_share > INPUT_BOUND_SHARE:
        console.say(
            f"[yellow]warning:[/] input-bound: {wait_share:.0%} of step time waits for data, "
            "which no precision speeds up; raise dataset.num_workers or make loading cheaper"
        )
    return {
        "samples_per_s": statistics.median(throughput),
        "samples_per_s_iqr": _iqr(throughput) if intervals > 1 else None,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "step_time_s": statistics.median(times),
        "step_time_s_iqr": _iqr(times) if intervals > 1 else None,
        # Nearest rank: one of the measured times, never below the median.
        "step_time_p90_s": sorted(times)[math.ceil(0.9 * len(times)) - 1],
        "speed_intervals": intervals,
        "data_wait_share": wait_share,
    }
