"""Forensics of a non-finite step: replay it with hooks on every layer and say where the
inf/NaN first appeared, which gradients overflowed, and what to try."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from runner.precision import Precision
from runner.task import Batch, Task

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
    gradients. RNG and gradients are left as found: the caller keeps gradients it needs."""
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
        with torch.random.fork_rng(devices=devices):
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
    if mode == "fp16_master":
        where = first or grad_first
        return (
            f"fp16 weights and activations overflowed{f' at {where}' if where else ''} "
            f"(|x| > {FP16_MAX:g}): keep it in fp32 (precision.fp32_modules), or use "
            "precision=fp16 (fp32 weights, fp16 compute) or precision=bf16 (fp32's range)"
        )
    if mode == "fp16" and first:
        return (
            f"fp16 overflowed in the forward pass at {first} (|x| > {FP16_MAX:g}): try precision=bf16 "
            f"(fp32's range), keep {first} in fp32, or lower the learning rate if the weights grew"
        )
    if mode == "fp16":
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


def full_report(info: dict, report: dict, mode: str) -> dict:
    return info | report | {"hint": hint(mode, report)}
