"""Measurements of a run: step timing by logging interval, what the process got of the machine in
each (runner/measure/contention.py), where the fit's wall time went, peak memory, compile counts,
and when to audit a step (runner/measure/flops.py has the FLOPs, MFU and the audit; speed.py the
speed figures)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from runner.measure.contention import Window
from runner.measure.flops import PrecisionAudit
from runner.measure.manifest_table import show as show_manifest
from runner.measure.matmuls import MatmulLog
from runner.measure.memory import SavedActivations, peak_memory_mb, peak_reserved_mb
from runner.measure.module_stack import ModuleStack
from runner.task import Batch
from runner.train.speed import WINDOW_KEYS, steady_speed
from runner.train.wall_time import Phases


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
        low_share: bool = False,
    ):
        self.cfg, self.device, self.world, self.num_tokens = cfg, device, world, num_tokens
        self.rows = rows  # every row logged (a resumed run starts with the earlier ones)
        self.audit: dict | None = None  # the precision audit of the last stage's first step
        self.task = task
        # the manifest's record of each audited step: {mode, step, ops, traffic (the projection's)}
        self.audited_steps: list[dict] = []
        self.activations = SavedActivations(task)  # counted in audited steps
        self.health: dict | None = None  # fp16's gradient health, from an audited step
        self._auditing, self._pending = False, []  # the steps not flushed yet
        self.phases = Phases()  # where a fit's wall time goes (each fit's: `start`)
        self.low_share = LowShare(low_share)  # rows carry it: the autopilot's runs

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
        self.phases = Phases()
        self.window = Window(self.device)  # the interval's share of the machine
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
        with torch.compiler.set_stance("force_eager"), self.phases.timing("audited_step"):
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
                ops, traffic = matmuls.records(), matmuls.traffic()
                self.audited_steps.append(
                    {"mode": mode, "step": step, "ops": ops, "traffic": traffic}
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
                "low": self.low_share(self.audit),
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
        elapsed = time.perf_counter() - self.interval_start
        share = {k: v for k, v in self.window.read().items() if k in WINDOW_KEYS}
        step_time = elapsed / len(pending)
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
                | r["low"]
                | share
            )
        self.phases.interval(elapsed, rows[-1]["steady"])
        self.rows += rows
        return rows

    def lap(self) -> None:
        """The next interval starts now: evaluation and checkpoints are not step time."""
        self.window.start()
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
        self.fit_wall_s = time.perf_counter() - self.started
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
            "wall_time_s": self.fit_wall_s,  # the fit's: runner/train/wall_time.py has the run's
            "compiled_graphs": graphs - self._compiled_before[0],
            "graph_breaks": breaks - self._compiled_before[1],
            **(self.audit or {}),
        }


class LowShare:
    """The share of a step's FLOPs in the converting format, as the last audit counted them (the
    autopilot's switches are each followed by one; the step that decided a switch is recorded
    after its restage, before that audit): a row's `low_flop_share`, where rows carry it (`on`)."""

    def __init__(self, on: bool):
        self.on, self.last = on, None

    def __call__(self, audit: dict | None) -> dict:
        if audit and audit.get("flops_per_step"):
            self.last = (audit.get("converted_flops_per_step") or 0) / audit["flops_per_step"]
        return {"low_flop_share": self.last} if self.on and self.last is not None else {}
