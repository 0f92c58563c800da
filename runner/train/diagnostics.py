"""Forensics of a non-finite step: replay it with hooks on every layer and say where the
inf/NaN first appeared, which gradients overflowed, and what to try."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from runner import console
from runner.errors import TrainingStopped
from runner.files import write_text
from runner.precision import Precision, mode_of
from runner.task import Batch, Task, buffers_kept
from runner.tracking import dumps
from runner.train import distributed
from runner.train.distributed import Dist
from runner.train.telemetry import batch_samples

FP16_MAX = 65504.0


def _stats(value) -> tuple[bool, float] | None:
    tensors = (
        [value]
        if isinstance(value, torch.Tensor)
        else [
            v
            for v in (
                value.values()
                if isinstance(value, dict)
                else value
                if isinstance(value, tuple | list)
                else []
            )
            if isinstance(v, torch.Tensor)
        ]
    )
    tensors = [
        t.full_tensor() if isinstance(t, DTensor) else t
        for t in tensors
        if t.is_floating_point() and t.numel()
    ]
    if not tensors:
        return None
    finite = all(bool(torch.isfinite(t).all()) for t in tensors)
    largest = max(float(t.detach().abs().float().nan_to_num(nan=math.inf).max()) for t in tensors)
    return finite, largest


def replay(
    task: Task,
    precision: Precision,
    window: list[Batch],
    to_device,
    scale: float,
    loss_scale: float,
) -> dict:
    """Forward and backward of `window` again, as the step ran it (same autocast; the summed
    losses times `scale`, the step's loss scale over its normalisation), recording each leaf
    module's output, the gradient reaching that output (in backward order) and its parameters'
    gradients. RNG and buffers are left as found (the replay is a second train-mode forward, which
    would update BatchNorm's running statistics again); the caller keeps gradients it needs."""
    leaves = [(n, m) for n, m in task.named_modules() if n and not list(m.children())]
    forward: list[tuple[str, bool, float]] = []
    backward: list[tuple[str, bool]] = []

    def record(name, output):
        if (stats := _stats(output)) is None:
            return
        forward.append((name, *stats))
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda g: backward.append((name, _stats(g)[0])))

    hooks = [
        m.register_forward_hook(lambda _m, _i, out, name=name: record(name, out))
        for name, m in leaves
    ]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices), buffers_kept(task):
            task.zero_grad(set_to_none=True)
            for batch in window:
                with precision.autocast():
                    out = task(to_device(batch))
                    loss = sum(out.values()) if isinstance(out, dict) else out
                (loss * scale).backward()
    finally:
        for h in hooks:
            h.remove()
    grads = []
    for name, module in leaves:
        found = [p.grad for p in module.parameters(recurse=False) if p.grad is not None]
        if found:
            finite, largest = _stats(tuple(found))
            grads.append((name, finite, largest / loss_scale))
    task.zero_grad(set_to_none=True)
    # A module runs several times (e.g. per micro-batch): keep its first appearance.
    seen: dict[str, tuple[bool, float]] = {}
    for name, finite, largest in forward:
        prev = seen.get(name)
        seen[name] = (
            finite and (prev[0] if prev else True),
            max(largest, prev[1] if prev else 0.0),
        )
    order = list(seen)
    bad_forward = [n for n in order if not seen[n][0]]
    bad_backward = list(dict.fromkeys(n for n, finite in backward if not finite))
    return {
        "forward": {
            "first_nonfinite": bad_forward[0] if bad_forward else None,
            "nonfinite": bad_forward,
            "largest": sorted(((n, seen[n][1]) for n in order), key=lambda x: -x[1])[:5],
        },
        # The gradient reaching each module's output, in the order backward computed them.
        "backward": {
            "first_nonfinite": bad_backward[0] if bad_backward else None,
            "nonfinite": bad_backward,
        },
        "gradients": {
            "nonfinite": [n for n, finite, _ in grads if not finite],
            "largest": sorted(((n, g) for n, _, g in grads), key=lambda x: -x[1])[:5],
        },
    }


def found_something(report: dict) -> bool:
    return bool(
        report["forward"]["first_nonfinite"]
        or report["backward"]["first_nonfinite"]
        or report["gradients"]["nonfinite"]
    )


def hint(mode: str, report: dict) -> str:
    first = report["forward"]["first_nonfinite"]
    largest = report["forward"]["largest"]
    grad_first = report["backward"]["first_nonfinite"]
    held = mode_of(mode)  # asked what it holds and whether it scales, not matched by name
    if held.scales_loss and held.weights == "fp16":
        where = first or grad_first
        return (
            f"fp16 weights and activations overflowed{f' at {where}' if where else ''} "
            f"(|x| > {FP16_MAX:g}): keep it in fp32 (precision.fp32_modules), or use "
            "precision=fp16 (fp32 weights, fp16 compute) or precision=bf16 (fp32's range)"
        )
    if held.scales_loss and first:
        return (
            f"fp16 overflowed in the forward pass at {first} (|x| > {FP16_MAX:g}): try precision=bf16 "
            f"(fp32's range), keep {first} in fp32, or lower the learning rate if the weights grew"
        )
    if held.scales_loss:
        return (
            f"gradients overflowed fp16 at this loss scale"
            f"{f' (first at {grad_first}, in backward order)' if grad_first else ''}; the scaler backs off by itself, and if it "
            "keeps failing try precision=bf16 or a lower learning rate"
        )
    where = (
        f" (first at {first})"
        if first
        else (f" (largest output: {largest[0][0]})" if largest else "")
    )
    return (
        f"the loss or gradients became non-finite in {mode}{where}: lower the learning rate, clip "
        "gradients (trainer.gradient_clip_val), or check the data of this step"
    )


class Forensics:
    """A run's first non-finite step, replayed and written to nonfinite.json."""

    def __init__(
        self,
        task: Task,
        model: torch.nn.Module,
        precision: Precision,
        dist: Dist,
        out_dir: Path,
    ):
        self.task, self.model, self.precision, self.dist = task, model, precision, dist
        self.path = out_dir / "nonfinite.json"
        self.report: dict | None = None

    def resumed(self, skipped_steps: int) -> None:
        """A run resumed from a checkpoint that counts skipped steps had its first non-finite
        step before it: that step's report stays the run's (nonfinite.json, read back), and no
        later one replaces it. The checkpoint decides, so every rank agrees (the replay is
        collective); a rank that cannot read the file keeps a report that says so."""
        if not skipped_steps:
            return
        try:
            self.report = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.report = {
                "step": None,
                "hint": "the run's first non-finite step came before the checkpoint it resumed "
                f"from, and its report ({self.path}) cannot be read",
            }

    def replay(self, pending, params, to_device) -> dict:
        """The skipped step again, with hooks on every layer, on the weights it saw: the caller
        replays before any later step is applied (a skipped step changed nothing). Each rank
        replays its own micro-batches with the step's normalisation; the report is the first
        rank's that found something. The gradients already computed for the next step, if any,
        are kept aside."""
        loss_scale = float(pending.loss_scale)
        scale = loss_scale * self.dist.world / float(pending.norm)
        kept = [p.grad for p in params]
        # Eager (hooks; no recompiles); DDP's reducer must not average the replay's gradients.
        sharded = self.precision.sharded
        quiet = contextlib.nullcontext() if sharded else distributed.no_grad_sync(self.model)
        with torch.compiler.set_stance("force_eager"), quiet:
            report = replay(self.task, self.precision, pending.window, to_device, scale, loss_scale)
        for param, grad in zip(params, kept, strict=True):
            param.grad = grad
        reports = distributed.gather(report, self.dist)
        found = [r for r, rep in enumerate(reports) if found_something(rep)]
        rank = found[0] if found else 0
        return reports[rank] | {"rank": rank, "loss_scale": loss_scale}

    def on_skipped(
        self, pending, replayed: dict | None, rows: list[dict], in_a_row: int, stuck: bool
    ) -> None:
        """A skipped step, now logged in `rows`: the first is reported (`replayed`); a run
        `stuck` with `in_a_row` skipped steps stops."""
        row = next(r for r in reversed(rows) if r["step"] == pending.step)
        if replayed is not None:
            self._write(pending, row, rows, replayed)
        if stuck:
            raise TrainingStopped(
                f"training stopped at step {pending.step}: {in_a_row} steps in a row had "
                f"non-finite loss or gradients (loss scale {row['loss_scale']:g}); "
                f"{self.report['hint']}; see {self.path}"
            )

    def collapse(self, step: int) -> TrainingStopped:
        """The stop of a run whose loss scale overflowed at its floor, naming the layers the
        first non-finite step's report found (where fp16 overflowed first)."""
        report = self.report or {}
        first = [report.get(k, {}).get("first_nonfinite") for k in ("forward", "backward")]
        layers = [n for n in first if n] or report.get("gradients", {}).get("nonfinite", [])[:3]
        where = f": {', '.join(dict.fromkeys(layers))}" if layers else ""
        floor = self.precision.cfg.grad_scaler.min_scale
        return TrainingStopped(
            f"training stopped at step {step}: the loss scale collapsed to its floor "
            f"(precision.grad_scaler.min_scale={floor:g}): use bf16 or keep these layers fp32 "
            f"({self.path.name}{where}); checkpoint saved at step {step}"
        )

    def _write(self, pending, row: dict, rows: list[dict], replayed: dict) -> None:
        step, first_sample = row["step"], pending.first_sample
        samples = batch_samples(pending.window) * self.dist.world
        info = {
            "step": step,
            "precision": self.precision.mode,
            "samples": [first_sample, first_sample + samples],
            "loss": row["loss"],
            "grad_norm": row["grad_norm"],
            "loss_scale_history": [
                (r["step"], r["loss_scale"], r["skipped"]) for r in rows[-21:] if r["step"] <= step
            ],
        }
        self.report = info | replayed | {"hint": hint(self.precision.mode, replayed)}
        if self.dist.main:
            write_text(self.path, dumps(self.report, indent=2) + "\n")
        first = self.report["forward"]["first_nonfinite"]
        where = f", first in the forward pass at {first}" if first else ""
        console.say(f"[yellow]non-finite values at step {step}{where}; report: {self.path}[/]")
