"""The training loop, as the articles write it: a window of micro-batches → forward and backward
under the precision's autocast → one optimizer step → record → at a flush point: log, evaluate,
checkpoint. Timing lives in `Meter`, checkpoint files in `Checkpointer`, non-finite forensics in
`Forensics`, signals in `Preemption`, evaluation in `Evaluation`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runner import console
from runner.console import ProgressBar
from runner.errors import Preempted
from runner.measure.error_table import MatmulErrors
from runner.precision import Precision, StepResult
from runner.task import Batch, DataModule, Task
from runner.tracking import RunLog
from runner.train import distributed
from runner.train.checkpoint import Checkpointer
from runner.train.deadline import timed, watch
from runner.train.diagnostics import Forensics
from runner.train.distributed import Dist
from runner.train.evaluation import Evaluation
from runner.train.preemption import Preemption, Signals
from runner.train.telemetry import Meter, read_later
from runner.train.window import forward_backward, window_health


@dataclass(frozen=True)
class LoopSettings:
    """The trainer config's values the loop reads every step, read once per fit: an OmegaConf
    read costs microseconds of Python each, a bare loop pays none."""

    max_steps: int
    accumulate: int
    clip_val: float | None
    clip_algorithm: str
    clip_per_group: bool
    max_consecutive_nonfinite: int

    @classmethod
    def of(cls, cfg) -> LoopSettings:
        return cls(
            cfg.max_steps,
            cfg.accumulate_grad_batches,
            cfg.gradient_clip_val,
            cfg.gradient_clip_algorithm,
            cfg.gradient_clip_per_group,
            cfg.max_consecutive_nonfinite,
        )


@dataclass
class PendingStep:
    """An optimizer step whose skip flag is still on its way to the host."""

    step: int
    skipped: Callable[[], float]
    window: list[Batch]
    first_sample: int
    norm: torch.Tensor | int  # the window's target count, over all ranks
    loss_scale: torch.Tensor
    signalled: Callable[[], float]  # how many ranks had a preemption signal when it began


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
        self.optimizers, self.schedulers, self.log = optimizers, schedulers, log
        self.device, self.dist = device, dist or Dist()
        self.loop = LoopSettings.of(cfg)  # read again at each fit (a timing extends max_steps)
        self.params = [p for p in task.parameters() if p.requires_grad]
        # forward and backward through `model` (DDP, FSDP); evaluation etc. through the task
        self.model = model or task
        self.sharded = precision.sharded  # FSDP: each rank holds a shard of the weights
        self.step = self.samples_seen = self.skipped_steps = self.consecutive_skipped = 0
        self.collapsed = False  # the loss scale overflowed at its floor: the run stops
        self.lr = 0.0  # of the last step taken
        self.extra_state: dict = {}  # saved with each checkpoint (config, W&B run id)
        self.conversion: dict | None = None  # resumed from another precision: what changed
        rows, pilot = list(log.previous_rows), precision.autopilot is not None  # its FLOP share
        self.meter = Meter(cfg, device, self.dist.world, rows, task.num_tokens, task, pilot)
        self.evaluation = Evaluation(
            task, data, precision.autocast, cfg.limit_val_batches, self._to_device, self.sharded
        )
        self.checkpointer = Checkpointer(log.out_dir, self.dist, self.sharded, cfg.keep_last_k)
        self.forensics = Forensics(task, self.model, precision, self.dist, log.out_dir)
        self.errors = MatmulErrors(task, precision, cfg)  # each matmul's error, measured steps
        self.preemption = Preemption(self.dist)
        self.deadline = None  # the job's end time, watched by the run's own fit
        self._unsettled: PendingStep | None = None  # the last step, until its flag is read
        self._trouble: tuple[PendingStep, dict | None] | None = None  # skipped: report or stop

    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def fit(self, run_signals: Signals | None = None) -> dict:
        """Train to max_steps. `run_signals`: the run's own (runner/run.py), which this fit
        answers from its first step to its last, with the job's end time watched (rank 0)."""
        loop = self.loop = LoopSettings.of(self.cfg)
        loader = iter(self.data.train_loader(self.samples_seen, self.dist.rank, self.dist.world))
        self.meter.start(self.step)
        self.task.train()
        deadline = self.deadline = watch(self, run_signals)
        with (
            self.precision.fast_kernels,  # precision.cpu_kernels=fast: for this fit only
            ProgressBar(loop.max_steps, self.cfg.progress_bar) as bar,
            self.preemption.installed(run_signals),
        ):
            while self.step < loop.max_steps:
                if deadline is not None and deadline.near():  # the host clock only
                    self.preemption.time_up(deadline.why())
                    deadline = None  # asked for once
                window, data_wait = self.meter.fetch(loader, loop.accumulate)
                if self.precision.at_step(self.step):
                    console.say(f"precision: {self.precision.mode} from step {self.step + 1}")
                    self.meter.restage()
                health = (self.task, window, self.precision, self.dist, self._to_device)
                probe = functools.partial(window_health, *health)  # fp16's, when audited
                audit = (probe, self.precision.counting, self.precision.mode, self.step + 1)
                with self.errors.around(self.meter, audit):  # each matmul's error, if due
                    stepped = self.train_step(window)
                if stepped is not None:
                    self.step += 1
                    self.samples_seen += self.meter.record(
                        self.step, *stepped, window, data_wait, self.lr, self.precision.mode
                    )
                due = self.meter.due(self.step)
                stop_now = stepped is None or self.preemption.requested
                if not (any(due.values()) or self._trouble or stop_now):
                    continue
                self._flush(due, bar)
        return self.summary()

    def _flush(self, due: dict[str, bool], bar: ProgressBar) -> None:
        """A measurement point: the device is waited for here anyway. Log the interval, evaluate,
        report a non-finite step, and checkpoint; stop if preempted, stuck non-finite or the
        loss scale collapsed."""
        self.settle()
        rows = self.meter.flush(self.skipped_steps)
        if rows:
            # Written before evaluation: an evaluation that fails, or never returns, costs none.
            self.log.log_rows(rows)
            # Rank 0 evaluates while the others go on, unless the weights are sharded.
            if due["eval"] and (self.dist.main or self.sharded):
                with self.meter.phases.timing("evaluation"):
                    metrics = self.evaluation.at(self.step)
                if metrics:
                    rows[-1].update(metrics)
                    self.log.amend_last(rows[-1], metrics)
            last = rows[-1]
            bar.update(self.step, last["loss"], last["loss_scale"], last["samples_per_s"])
        if self._trouble:  # first non-finite step: nonfinite.json; too many in a row: stop
            trouble, self._trouble = self._trouble, None
            self.forensics.on_skipped(
                *trouble, self.meter.rows, self.consecutive_skipped, self._stuck
            )
        preempted, collapsed = self.preemption.requested, self.collapsed
        preempted = preempted and not self.preemption.completes(due["last"])
        if due["checkpoint"] or due["last"] or preempted or collapsed:
            with timed(self.deadline), self.meter.phases.timing("checkpoints"):  # time limit's too
                tensors = state_tensors(self.task, self.params)
                self.checkpointer.save(self.state_dict(), self.step, due["checkpoint"], tensors)
        if preempted:
            raise Preempted(self.preemption.signal, self.step, self.preemption.why)
        if collapsed:  # checkpointed: skipped steps left the weights finite, resumable in bf16
            raise self.forensics.collapse(self.step)
        self.meter.lap()

    def train_step(self, window: list[Batch]) -> tuple[dict[str, torch.Tensor], StepResult] | None:
        """One optimizer step over an accumulation window. Returns the window's mean losses (on
        the device): `loss`, and `loss_<group>` for each loss of a multi-optimizer task; or None
        when the previous step's outcome stops the run (the window is then not stepped)."""
        # Every loss is divided by the window's target count (masked tokens for MLM) over all
        # ranks, so k micro-batches of b give the gradient of one batch of k·b.
        count = sum(self.task.num_targets(b) for b in window)  # host-side: no device sync
        # The preemption flag travels with it: every rank learns of a signal to any one of them.
        norm, signalled = distributed.count_over_ranks(
            count, self.preemption.flag, self.dist, self.device
        )
        totals = forward_backward(
            self.model, window, norm, self.precision, self.meter, self.dist, self._to_device
        )
        # This step's work is queued: waiting for the previous step's flag leaves no gap.
        self.settle()
        if self._stuck or self.collapsed:
            zero_grad(self.optimizers)
            return None
        self.lr = next(iter(self.optimizers.values())).param_groups[0]["lr"]
        result = self.precision.step(
            list(self.optimizers.values()),
            self.params,
            self.loop.clip_val,
            self.loop.clip_algorithm,
            loss=totals["loss"],
            clip_per_group=self.loop.clip_per_group,
        )
        zero_grad(self.optimizers)
        self._unsettled = PendingStep(
            self.step + 1,
            read_later(result.skipped),
            window,
            self.samples_seen,
            norm,
            result.loss_scale,
            read_later(signalled),
        )
        return totals, result

    def settle(self) -> None:
        """Books the last optimizer step once its skip flag is on the host: skip counters, and the
        LR schedule, which only applied steps advance. Called once the next step's work is queued
        (or at a flush), so the device never idles; a first skipped step is replayed here."""
        if self._unsettled is None:
            return
        pending, self._unsettled = self._unsettled, None
        self.preemption.hear(pending.signalled())
        if not pending.skipped():
            self.consecutive_skipped = 0
            for scheduler in self.schedulers.values():
                scheduler.step()
            return
        self.skipped_steps += 1
        self.consecutive_skipped += 1
        self.collapsed = self.precision.loss_scaler.collapsed()  # read on skipped steps only
        first = self.forensics.report is None
        if self._trouble is None and (first or self._stuck):
            replay = first and self.forensics.replay(pending, self.params, self._to_device)
            self._trouble = (pending, replay or None)

    @property
    def _stuck(self) -> bool:
        return self.consecutive_skipped >= self.loop.max_consecutive_nonfinite

    def state_dict(self) -> dict:
        self.settle()
        return self.checkpointer.state(self)

    def load_state_dict(self, state: dict) -> None:
        """Everything a checkpoint holds, so the run continues bit for bit."""
        self.checkpointer.restore(self, state)
        self.forensics.resumed(self.skipped_steps)  # a first non-finite step's report stays

    def summary(self) -> dict:
        return {
            "steps": self.step,
            "skipped_steps": self.skipped_steps,
            "final_loss_scale": self.precision.loss_scale,
            **self.meter.summary(),
            **self.evaluation.summary(),
            **({"resumed_across_precision": self.conversion} if self.conversion else {}),
        }


def zero_grad(optimizers: dict[str, torch.optim.Optimizer]) -> None:
    for optimizer in optimizers.values():
        optimizer.zero_grad(set_to_none=True)


def state_tensors(task: Task, params: list) -> list[tuple[str, torch.Tensor]]:
    """What a checkpoint must not hold non-finite: the trainable weights and the buffers
    (BatchNorm's running statistics take a skipped step's forward in)."""
    names = {p: n for n, p in task.named_parameters()}
    return [(names[p], p) for p in params] + list(task.named_buffers())
