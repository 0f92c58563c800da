"""The training loop: accumulation windows, logging at intervals, evaluation, checkpoints,
preemption signals, and stopping on persistent non-finite values."""

from __future__ import annotations

import contextlib
import math
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runner import checkpoint, console, diagnostics, distributed
from runner.console import ProgressBar
from runner.distributed import Dist
from runner.errors import Preempted, TrainingStopped, UserError
from runner.precision import Precision, StepResult
from runner.task import Batch, DataModule, Task
from runner.telemetry import PrecisionAudit, peak_memory_mb, peak_reserved_mb
from runner.tracking import RunLog, dumps

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
INPUT_BOUND_SHARE = 0.2  # above this share of step time spent waiting for data, warn


def batch_samples(window: list[Batch]) -> int:
    return sum(len(next(iter(b.values()))) for b in window)


def read_later(value: torch.Tensor) -> Callable[[], float | list[float]]:
    """Starts copying device flags to the host and returns their reader, which waits for that
    copy only, not for the work queued after it. On the CPU there is nothing to wait for."""
    if value.device.type != "cuda":
        return value.tolist
    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    host.copy_(value, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> float | list[float]:
        copied.synchronize()
        return host.tolist()

    return read


def compile_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process: Dynamo's own counters."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@dataclass
class PendingStep:
    """An optimizer step whose skip flag is still on its way to the host."""

    step: int
    read: Callable[[], float | list[float]]
    window: list[Batch]
    first_sample: int
    norm: torch.Tensor | int  # the window's target count, over all ranks
    loss_scale: torch.Tensor


class Trainer:
    def __init__(
        self,
        cfg,
        task: Task,
        data: DataModule,
        precision: Precision,
        optimizers: dict[str, torch.optim.Optimizer],
        schedulers: dict[str, torch.optim.lr_scheduler.LRScheduler],
        log: RunLog,
        device: torch.device,
        dist: Dist | None = None,
        model: torch.nn.Module | None = None,
    ):
        self.cfg, self.task, self.data, self.precision = cfg, task, data, precision
        self.optimizers, self.schedulers, self.log, self.device = (
            optimizers,
            schedulers,
            log,
            device,
        )
        self.params = [p for p in task.parameters() if p.requires_grad]
        self.dist = dist = dist or Dist()
        # The forward and backward go through `model` (DDP or FSDP over several ranks); the rest
        # (evaluation, checkpoints, diagnostics) uses the task itself.
        self.model = model or task
        self.sharded = precision.sharded  # FSDP: each rank holds a shard of the weights
        self.step = 0
        self.samples_seen = 0
        self.skipped_steps = 0
        self.consecutive_skipped = 0
        self.rows: list[dict] = list(log.previous_rows)  # every row logged, for the summary
        self.extra_state: dict = {}  # saved with each checkpoint (config, W&B run id)
        self.nonfinite_report: dict | None = None
        self.audit: dict | None = None
        self.lr = 0.0  # of the last step taken
        self._unsettled: PendingStep | None = None  # the last step, until its flag is read
        # A skipped step to report (with its replay), or to stop the run at
        self._trouble: tuple[PendingStep, dict | None] | None = None
        self._signal: str | None = None  # a preemption signal this process received
        self._stop = False  # every rank agrees to stop (one process: the signal itself)

    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def train_step(self, window: list[Batch]) -> tuple[dict[str, torch.Tensor], StepResult] | None:
        """One optimizer step over an accumulation window. Every micro-batch's loss is divided by
        the window's target count (masked tokens for MLM), so k micro-batches of b give the same
        gradient as one batch of k·b. Returns the window's mean losses (on the device): `loss`,
        and `loss_<group>` for each loss of a multi-optimizer task; or None when the previous
        step's outcome says the run must stop (this window is then not stepped)."""
        # Counted on the host-side batches: no device sync. Several ranks add up their counts
        # (and whether any received a preemption signal) on the device.
        count = sum(self.task.num_targets(b) for b in window)
        if self.dist.enabled:
            shared = torch.tensor([count, self._signal is not None], dtype=torch.float32)
            if self.device.type == "cuda":  # a copy from pinned memory does not wait for the GPU
                shared = shared.pin_memory()
            norm = distributed.sum_(shared.to(self.device, non_blocking=True), self.dist)
            stop, norm = norm[1], norm[0].clamp(min=1)
        else:
            stop, norm = None, max(1, count)
        totals: dict[str, torch.Tensor] = {}
        for i, batch in enumerate(window):
            batch = self._to_device(batch)
            # DDP averages gradients over ranks once per window: on its last micro-batch.
            syncs = not self.dist.enabled or i == len(window) - 1
            with contextlib.nullcontext() if syncs else distributed.no_grad_sync(self.model):
                with self.precision.autocast():
                    losses = self.model(batch)
                    if isinstance(losses, torch.Tensor):
                        losses = {"loss": losses}
                    losses = {k: v / norm for k, v in losses.items()}
                # × ranks: DDP's average over ranks then leaves the sum over the global window.
                self.precision.backward(
                    [v * self.dist.world for v in losses.values()]
                    if self.dist.enabled
                    else list(losses.values())
                )
            for key, loss in losses.items():
                totals[key] = totals.get(key, 0) + loss.detach().float()
        if self.dist.enabled:  # the global window's losses: the same on every rank
            summed = distributed.sum_(torch.stack(list(totals.values())), self.dist)
            totals = dict(zip(totals, summed.unbind(), strict=True))
        if "loss" not in totals:
            totals = {f"loss_{k}": v for k, v in totals.items()}
            totals["loss"] = sum(totals.values())
        # This step's work is queued: waiting for the previous step's flag leaves no gap.
        self.settle()
        if self.consecutive_skipped >= self.cfg.max_consecutive_nonfinite:
            self._zero_grad()
            return None
        self.lr = next(iter(self.optimizers.values())).param_groups[0]["lr"]
        result = self.precision.step(
            list(self.optimizers.values()),
            self.params,
            self.cfg.gradient_clip_val,
            self.cfg.gradient_clip_algorithm,
            loss=totals["loss"],
            clip_per_group=self.cfg.gradient_clip_per_group,
        )
        self._zero_grad()
        flags = result.skipped if stop is None else torch.stack([result.skipped, stop])
        self._unsettled = PendingStep(
            self.step + 1, read_later(flags), window, self.samples_seen, norm, result.loss_scale
        )
        return totals, result

    def _zero_grad(self) -> None:
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)

    def settle(self) -> None:
        """Books the last optimizer step once its skip flag is on the host: the skip counters,
        and the LR schedule, which only applied steps advance. Called once the next step's work
        is queued (or at a measurement point), so the device never idles while the host waits."""
        if self._unsettled is None:
            return
        pending, self._unsettled = self._unsettled, None
        flags = pending.read()
        skipped = flags[0] if self.dist.enabled else flags
        if self.dist.enabled:
            self._stop |= bool(flags[1])
        if not skipped:
            self.consecutive_skipped = 0
            for scheduler in self.schedulers.values():
                scheduler.step()
            return
        self.skipped_steps += 1
        self.consecutive_skipped += 1
        first = self.nonfinite_report is None
        if self._trouble is None and (
            first or self.consecutive_skipped >= self.cfg.max_consecutive_nonfinite
        ):
            self._trouble = (pending, self._replay(pending) if first else None)

    def _replay(self, pending: PendingStep) -> dict:
        """The skipped step again, with hooks on every layer, on the weights it saw: no later
        step has been applied yet (a skipped step changed nothing). Each rank replays its own
        micro-batches with the step's normalisation; the report is the first rank's that found
        something. The gradients already computed for the next step are kept aside."""
        loss_scale = float(pending.loss_scale)
        scale = loss_scale * self.dist.world / float(pending.norm)
        kept = [p.grad for p in self.params]
        # Eager (hooks; no recompiles); DDP's reducer must not average the replay's gradients.
        quiet = contextlib.nullcontext() if self.sharded else distributed.no_grad_sync(self.model)
        with torch.compiler.set_stance("force_eager"), quiet:
            report = diagnostics.replay(
                self.task, self.precision, pending.window, self._to_device, scale, loss_scale
            )
        for param, grad in zip(self.params, kept, strict=True):
            param.grad = grad
        reports = distributed.gather(report, self.dist)
        found = [r for r, rep in enumerate(reports) if diagnostics.found_something(rep)]
        rank = found[0] if found else 0
        return reports[rank] | {"rank": rank, "loss_scale": loss_scale}

    @torch.inference_mode()
    def evaluate(self) -> dict[str, float]:
        """Under inference_mode and the same autocast as training."""
        loader = self.data.val_loader(self.cfg.limit_val_batches)
        if loader is None:
            return {}
        self.task.eval()
        sums: dict[str, torch.Tensor] = {}
        count = 0
        with distributed.gathered(self.task, self.sharded):
            for batch in loader:
                count += self.task.num_targets(batch)
                with self.precision.autocast():
                    for key, value in self.task.eval_sums(self._to_device(batch)).items():
                        sums[key] = sums.get(key, 0) + value.float()
        self.task.train()
        totals = dict(zip(sums, torch.stack(list(sums.values())).tolist(), strict=True))
        return {f"eval_{key}": v for key, v in self.task.eval_metrics(totals, count).items()}

    def fit(self) -> dict:
        cfg = self.cfg
        loader = iter(self.data.train_loader(self.samples_seen, self.dist.rank, self.dist.world))
        self.first_step = self.step
        self._compiled_before = compile_counts()  # a multirun's earlier jobs compiled too
        pending: list[dict] = []
        self.task.train()
        started = interval_start = time.perf_counter()
        with ProgressBar(cfg.max_steps, cfg.progress_bar) as bar, self._preemption_signals():
            while self.step < cfg.max_steps:
                fetch_start = time.perf_counter()
                window = [next(loader) for _ in range(cfg.accumulate_grad_batches)]
                data_wait = time.perf_counter() - fetch_start  # host time: no device sync
                if self.precision.at_step(self.step):
                    console.say(f"precision: {self.precision.mode} from step {self.step + 1}")
                    self.audit = None  # audit the new stage: the summary has the last stage's
                if self.audit is None:  # the run's first step: which dtype each op ran in
                    # Eager: Dynamo skips a frame it meets under a dispatch mode, for good.
                    with torch.compiler.set_stance("force_eager"), PrecisionAudit() as audit:
                        stepped = self.train_step(window)
                    self.audit = audit.report()
                else:
                    stepped = self.train_step(window)
                if stepped is not None:
                    losses, result = stepped
                    self.step += 1
                    samples = batch_samples(window) * self.dist.world
                    self.samples_seen += samples
                    pending.append(
                        {
                            "step": self.step,
                            "device_values": losses
                            | {
                                "grad_norm": result.grad_norm,
                                "loss_scale": result.loss_scale,
                                "skipped": result.skipped,
                            },
                            "lr": self.lr,
                            "precision": self.precision.mode,
                            "data_wait_s": data_wait,
                            "samples": samples,
                            "tokens": sum(self.task.num_tokens(b) for b in window)
                            * self.dist.world,
                        }
                    )
                last = self.step == cfg.max_steps
                eval_due = cfg.val_check_interval > 0 and (
                    self.step % cfg.val_check_interval == 0 or last
                )
                ckpt_due = cfg.checkpoint_every_n_steps > 0 and (
                    self.step % cfg.checkpoint_every_n_steps == 0
                )
                # The warm-up ends on an interval boundary, so steady timings start clean.
                warmup_end = self.step == self.first_step + cfg.benchmark.warmup_steps
                flush = (
                    not self.step % cfg.log_every_n_steps
                    or last
                    or eval_due
                    or ckpt_due
                    or warmup_end
                )
                if not (flush or self._trouble or self.stopping or stepped is None):
                    continue
                self.settle()  # a measurement point: the device is waited for here anyway
                if pending:
                    rows = self._finish_interval(pending, interval_start)
                    pending = []
                    # Rank 0 evaluates while the others go on, unless the weights are sharded.
                    if eval_due and (self.dist.main or self.sharded):
                        rows[-1].update(self.evaluate())
                    self.log.log_rows(rows)
                    self.rows += rows
                    bar.update(
                        self.step,
                        rows[-1]["loss"],
                        rows[-1]["loss_scale"],
                        rows[-1]["samples_per_s"],
                    )
                if self._trouble:
                    self._on_nonfinite(*self._trouble)
                if ckpt_due or last or self.stopping:
                    self.save_checkpoint(step_file=ckpt_due)
                if self.stopping:
                    raise Preempted(
                        self._signal or "a preemption signal to another rank", self.step
                    )
                interval_start = time.perf_counter()
        return self.summary(time.perf_counter() - started)

    @property
    def stopping(self) -> bool:
        """Preempted: with several ranks, once all of them know (they stop at the same step)."""
        return self._stop if self.dist.enabled else self._signal is not None

    @contextlib.contextmanager
    def _preemption_signals(self):
        """SIGTERM/SIGUSR1 (cluster preemption) finish the current step, then checkpoint."""
        previous = {}
        if threading.current_thread() is threading.main_thread():

            def handle(signum, _frame):
                self._signal = signal.Signals(signum).name

            previous = {sig: signal.signal(sig, handle) for sig in PREEMPTION_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_nonfinite(self, pending: PendingStep, replayed: dict | None) -> None:
        """First non-finite step: write nonfinite.json. Too many in a row: stop the run."""
        self._trouble = None
        step = pending.step
        row = next(r for r in reversed(self.rows) if r["step"] == step)
        path = self.log.out_dir / "nonfinite.json"
        if replayed is not None:
            first_sample = pending.first_sample
            info = {
                "step": step,
                "precision": self.precision.mode,
                "samples": [
                    first_sample,
                    first_sample + batch_samples(pending.window) * self.dist.world,
                ],
                "loss": row["loss"],
                "grad_norm": row["grad_norm"],
                "loss_scale_history": [
                    (r["step"], r["loss_scale"], r["skipped"])
                    for r in self.rows[-21:]
                    if r["step"] <= step
                ],
            }
            self.nonfinite_report = diagnostics.full_report(info, replayed, self.precision.mode)
            if self.dist.main:
                path.write_text(dumps(self.nonfinite_report, indent=2) + "\n")
            first = self.nonfinite_report["forward"]["first_nonfinite"]
            where = f", first in the forward pass at {first}" if first else ""
            console.say(f"[yellow]non-finite values at step {step}{where}; report: {path}[/]")
        if self.consecutive_skipped >= self.cfg.max_consecutive_nonfinite:
            raise TrainingStopped(
                f"training stopped at step {self.step}: {self.consecutive_skipped} steps in a row had "
                f"non-finite loss or gradients (loss scale {row['loss_scale']:g}); "
                f"{self.nonfinite_report['hint']}; see {path}"
            )

    def _finish_interval(self, pending: list[dict], interval_start: float) -> list[dict]:
        """Read the interval's device values in one transfer (the only sync), then time it. Each
        step is given the interval's mean step time: exact on any device, with no per-step sync."""
        keys = list(pending[0]["device_values"])
        values = torch.stack([torch.stack([r["device_values"][k] for k in keys]) for r in pending])
        values = values.tolist()
        step_time = (time.perf_counter() - interval_start) / len(pending)
        memory = peak_memory_mb(self.device)
        # Every step up to here is settled: count the skips back from the total.
        skipped_total = self.skipped_steps - sum(v[keys.index("skipped")] > 0 for v in values)
        rows = []
        for r, row_values in zip(pending, values, strict=True):
            row = {"step": r["step"], **dict(zip(keys, row_values, strict=True))}
            row["skipped"] = row["skipped"] > 0
            skipped_total += row["skipped"]
            rows.append(
                row
                | {
                    "skipped_total": skipped_total,
                    "lr": r["lr"],
                    "precision": r["precision"],
                    "data_wait_s": r["data_wait_s"],
                }
                | {
                    "step_time_s": step_time,
                    "samples_per_s": r["samples"] / step_time,
                    "tokens_per_s": r["tokens"] / step_time,
                    "peak_memory_mb": memory,
                }
            )
        return rows

    def speed(self) -> dict:
        """Median throughput, median and p90 step time, and the share of step time spent waiting
        for data, over the steady window (this run's steps after the warm-up)."""
        start = self.first_step + self.cfg.benchmark.warmup_steps
        steady = [r for r in self.rows if r["step"] > start] or self.rows[-1:]
        times = [r["step_time_s"] for r in steady]
        wait_share = sum(r["data_wait_s"] for r in steady) / max(sum(times), 1e-12)
        if wait_share > INPUT_BOUND_SHARE:
            console.say(
                f"[yellow]warning:[/] input-bound: {wait_share:.0%} of step time waits for data, "
                "which no precision speeds up; raise dataset.num_workers or make loading cheaper"
            )
        return {
            "samples_per_s": statistics.median(r["samples_per_s"] for r in steady),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "step_time_s": statistics.median(times),
            # Nearest rank: one of the measured times, never below the median.
            "step_time_p90_s": sorted(times)[math.ceil(0.9 * len(times)) - 1],
            "data_wait_share": wait_share,
        }

    def state_dict(self) -> dict:
        self.settle()
        return {
            "model": self.task.state_dict(),
            # One optimizer: its state dict. Several (a GAN): a dict of them by group name.
            "optimizer": self._by_group(self.optimizers),
            **self.precision.state_dict(),
            "scheduler": self._by_group(self.schedulers),
            "step": self.step,
            "samples_seen": self.samples_seen,
            "skipped_steps": self.skipped_steps,
            "consecutive_skipped": self.consecutive_skipped,
            "precision": self.precision.name,
            "rng": checkpoint.rng_state(),
            **self.extra_state,
        } | self._rank_rng()

    def _rank_rng(self) -> dict:
        """Each rank's RNG state (dropout differs by rank), gathered for rank 0 to save."""
        states = distributed.gather(checkpoint.rng_state(), self.dist)
        return {"rng_by_rank": states} if self.dist.enabled else {}

    def load_state_dict(self, state: dict) -> None:
        """Everything a checkpoint holds, so the run continues bit for bit."""
        try:
            self.task.load_state_dict(state["model"])
        except RuntimeError as e:
            mismatch = next(
                (
                    line.strip()
                    for line in str(e).splitlines()
                    if "size mismatch" in line or "Missing" in line or "Unexpected" in line
                ),
                str(e).splitlines()[0],
            )
            raise UserError(f"the checkpoint does not fit this model config: {mismatch}") from None
        for key, objects in (("optimizer", self.optimizers), ("scheduler", self.schedulers)):
            saved = state[key] if len(objects) > 1 else {next(iter(objects)): state[key]}
            if set(saved) != set(objects):
                raise UserError(
                    f"the checkpoint's {key}s ({', '.join(saved)}) do not fit this task"
                )
            for name, obj in objects.items():
                obj.load_state_dict(saved[name])
        self.step, self.samples_seen = state["step"], state["samples_seen"]
        self.precision.at_step(self.step)  # a staged run resumes in its stage
        self.precision.load_state_dict(state)
        self.skipped_steps = state.get("skipped_steps", 0)
        self.consecutive_skipped = state.get("consecutive_skipped", 0)
        by_rank = state.get("rng_by_rank") or []
        if self.dist.enabled and len(by_rank) != self.dist.world:
            console.say(
                f"[yellow]warning:[/] the checkpoint was written by {len(by_rank) or 1} rank(s), "
                f"this run has {self.dist.world}: dropout's random stream will differ"
            )
        own = by_rank[self.dist.rank] if len(by_rank) == self.dist.world else state["rng"]
        checkpoint.set_rng_state(own)

    @staticmethod
    def _by_group(objects: dict) -> dict:
        states = {name: obj.state_dict() for name, obj in objects.items()}
        return next(iter(states.values())) if len(states) == 1 else states

    def save_checkpoint(self, step_file: bool) -> None:
        if not all(torch.isfinite(p).all() for p in self.params):
            raise TrainingStopped(f"refusing to checkpoint non-finite weights at step {self.step}")
        folder = self.log.out_dir / "checkpoints"
        state = self.state_dict()  # on every rank: it gathers their RNG states
        names = ([f"step-{self.step}.pt"] if step_file else []) + ["last.pt"]
        if self.sharded:  # every rank writes its shard; rank 0's file, written last, names them
            state["shards"] = self.dist.world
            if not self.dist.main:
                for name in names:
                    checkpoint.save(checkpoint.shard_path(folder / name, self.dist.rank), state)
            distributed.barrier(self.dist)
        if not self.dist.main:
            return
        for name in names:
            checkpoint.save(folder / name, state)
        if step_file:
            checkpoint.prune(folder, self.cfg.keep_last_k)

    def summary(self, wall_time_s: float) -> dict:
        last = self.rows[-1]
        evals = [r for r in self.rows if "eval_loss" in r]
        graphs, breaks = compile_counts()
        return {
            "steps": self.step,
            "skipped_steps": self.skipped_steps,
            "final_loss": last["loss"],
            "final_grad_norm": last["grad_norm"],
            "final_loss_scale": self.precision.loss_scale,
            **({k: v for k, v in evals[-1].items() if k.startswith("eval_")} if evals else {}),
            **({"best_eval_loss": min(r["eval_loss"] for r in evals)} if evals else {}),
            **self.speed(),
            "peak_memory_mb": peak_memory_mb(self.device),
            "peak_reserved_mb": peak_reserved_mb(self.device),
            "wall_time_s": wall_time_s,
            "compiled_graphs": graphs - self._compiled_before[0],
            "graph_breaks": breaks - self._compiled_before[1],
            **(self.audit or {}),
        }
