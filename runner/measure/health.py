"""fp16 health, measured: how much of the gradient fp16 loses without loss scaling and with the
scale in force, how close the activations come to fp16's largest value, and what the run's
loss-scale history says to change."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from runner.precision.modes import mode_of
from runner.task import Batch, Task, buffers_kept

FP16_MAX = 65504.0
FP16_TINY = 2.0**-24  # the smallest fp16 subnormal: anything smaller in magnitude becomes 0
FP16_NORMAL = 2.0**-14  # below this, fp16 keeps fewer significant bits (subnormal)
# A share of the gradient's elements below fp16's normal range (flushed to zero, or subnormal:
# fewer significant bits) worth acting on; a recommended scale lifts all but TARGET_LOW above it.
# (A tiny share always lies there: gradients that are rounding noise, a millionth of the rest.)
LOW_ALARM = 1e-2
TARGET_LOW = 1e-2
COLLAPSE_SKIPPED_SHARE = 0.1  # skipping more steps than this, the scale keeps collapsing
MEASURED = (
    "underflow_share_unscaled",
    "underflow_share_scaled",
    "subnormal_share",
    "activation_max",
    "activation_headroom_log2",
    "gradient_headroom_log2",
    "audited_scale",
)


def gradient_health(task: Task, batch: Batch, norm: float, scale: float) -> dict:
    """One micro-batch in fp32 (autocast off, nothing scaled): its true gradients, as the step
    normalises them (`norm`: the window's target count), against fp16's range at scale 1 and at
    `scale`; and the largest value any module outputs, against fp16's largest. The weights'
    gradients stand for the activations' (the same values, summed). The run goes on as if
    unmeasured: `.grad` is left alone, and the RNG and buffers (dropout, batch statistics) are
    put back."""
    device = batch[next(iter(batch))].device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with buffers_kept(task):
            return _measure(task, batch, norm, scale)


def _measure(task: Task, batch: Batch, norm: float, scale: float) -> dict:
    largest = 0.0

    def watch(_module, _inputs, output) -> None:
        nonlocal largest
        if isinstance(output, torch.Tensor) and output.is_floating_point() and output.numel():
            largest = max(largest, float(output.detach().abs().nan_to_num(0.0).max()))

    params = [p for p in task.parameters() if p.requires_grad]
    hooks = [m.register_forward_hook(watch) for m in task.modules()]
    try:
        loss = task(batch)
        if isinstance(loss, dict):  # several optimizers: their losses together
            loss = sum(loss.values())
        grads = torch.autograd.grad(loss / norm, params, allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()
    magnitudes = torch.cat([g.detach().abs().flatten().float() for g in grads if g is not None])
    magnitudes = magnitudes[(magnitudes > 0) & magnitudes.isfinite()]  # inf/NaN: not fp16's range
    count = max(magnitudes.numel(), 1)

    def share(condition: torch.Tensor) -> float:
        return float(condition.sum()) / count

    scaled = magnitudes * scale
    top = float(magnitudes.max()) if magnitudes.numel() else 0.0
    return {
        "gradient_headroom_log2": math.log2(FP16_MAX / top) if top else None,
        "underflow_share_unscaled": share(magnitudes < FP16_TINY),
        "underflow_share_scaled": share(scaled < FP16_TINY),
        "subnormal_share": share((scaled >= FP16_TINY) & (scaled < FP16_NORMAL)),
        "activation_max": largest,
        "activation_headroom_log2": math.log2(FP16_MAX / largest)
        if 0 < largest < math.inf
        else None,
        # all but TARGET_LOW of the gradient lies above it: what a scale should lift past normal
        "gradient_low_quantile": float(
            magnitudes.kthvalue(max(1, int(TARGET_LOW * magnitudes.numel()))).values
        )
        if magnitudes.numel()
        else None,
        "audited_scale": scale,
    }


def scale_history(rows: list[dict]) -> dict:
    """From the rows of the loss-scaled steps: the smallest and last scale, how often it backed
    off, how many steps it skipped, how many of those were the first steps, in a row, and the
    largest scale of an applied step below every skipped step's (a cap that would have kept
    GradScaler from probing into overflows)."""
    scales = [r["loss_scale"] for r in rows]
    backoffs = sum(b < a for a, b in zip(scales, scales[1:], strict=False))
    leading = next((i for i, r in enumerate(rows) if not r["skipped"]), len(rows))
    overflowed = min((r["loss_scale"] for r in rows if r["skipped"]), default=None)
    below = [r["loss_scale"] for r in rows if overflowed and r["loss_scale"] < overflowed]
    return {
        "scale_safe_max": max(below, default=None),
        "scale_min": min(scales),
        "scale_final": scales[-1],
        "scale_backoffs": backoffs,
        "skipped_steps": sum(bool(r["skipped"]) for r in rows),
        "leading_skipped_steps": leading,
        "steps": len(rows),
    }


def recommend(health: dict, history: dict, grad_scaler) -> str:
    """One sentence: what to change in `grad_scaler` (precision.grad_scaler), or that the
    settings suit the model ("ok", only where no loss-scaled step was skipped)."""
    skipped, steps = history["skipped_steps"], history["steps"]
    init_scale, growth_interval = grad_scaler.init_scale, grad_scaler.growth_interval
    if skipped > COLLAPSE_SKIPPED_SHARE * steps and history["scale_min"] < 1:
        floor = (  # a floor stops such a run where it stops learning, with a checkpoint
            "; precision.grad_scaler.min_scale=1 stops a run whose scale falls that low"
            if grad_scaler.min_scale is None
            else ""
        )
        return (
            f"use bf16: the scale keeps collapsing ({skipped} of {steps} steps skipped, down to "
            f"{history['scale_min']:g}){floor}"
        )
    headroom = health.get("gradient_headroom_log2")  # the largest gradient stays finite, ×2 spare
    ceiling = 2.0 ** (math.floor(headroom) - 1) if headroom is not None else math.inf
    if skipped == steps:
        fix = (  # (an infinite init_scale is refused before the run)
            f"lower precision.grad_scaler.init_scale to {ceiling:g}"
            if ceiling < history["scale_final"]
            else "lower precision.grad_scaler.init_scale, or use bf16"
        )
        return (
            f"{fix}: every one of the {steps} loss-scaled steps was skipped (non-finite "
            f"gradients, the last at scale {history['scale_final']:g}), so nothing trained"
        )
    quantile = health.get("gradient_low_quantile")
    low = (health.get("underflow_share_scaled") or 0) + (health.get("subnormal_share") or 0)
    if low > LOW_ALARM and quantile:
        new = min(2.0 ** math.ceil(math.log2(FP16_NORMAL / quantile)), ceiling)
        if new > health["audited_scale"]:
            return (
                f"raise precision.grad_scaler.init_scale to {new:g}: at "
                f"{health['audited_scale']:g}, {low:.1%} of the gradient falls below fp16's "
                f"normal range ({health['underflow_share_scaled']:.1%} to zero)"
            )
    # A cap just below where every skipped step's scale lay: GradScaler stops probing into them.
    safe = history.get("scale_safe_max") if grad_scaler.max_scale is None else None
    cap = safe and f"precision.grad_scaler.max_scale={safe:g} (below every scale that overflowed)"
    if history["scale_backoffs"] > steps // 4 and steps >= 8:
        return (
            f"raise precision.grad_scaler.growth_interval above {growth_interval}"
            f"{f', or set {cap}' if safe else ''}: the scale backed off "
            f"{history['scale_backoffs']} times in {steps} steps"
        )
    if skipped and ceiling < init_scale:
        return (
            f"lower precision.grad_scaler.init_scale to {ceiling:g}: {skipped} of {steps} steps "
            f"were skipped, and the largest gradient leaves fp16's range at a scale of about "
            f"{2.0**headroom:.3g}"
        )
    if skipped and skipped == history["leading_skipped_steps"]:
        return (
            f"lower precision.grad_scaler.init_scale to {history['scale_final']:g}: the first "
            f"{skipped} of {steps} steps were skipped while the scale came down to it"
        )
    if skipped:
        return (
            f"{skipped} of {steps} steps were skipped (non-finite gradients at the scale in "
            f"force; down to {history['scale_min']:g}): rare skips are GradScaler trying a "
            "higher scale, frequent ones a model that overflows fp16 (nonfinite.json has the "
            f"first){f'; {cap} avoids them' if safe else ''}"
        )
    return "ok: the loss scale suits this model"


def fp16_health(
    measured: dict | None, rows: list[dict], grad_scaler, modes: Iterable[str]
) -> dict | None:
    """`summary.json`'s `fp16_health` for a run with loss-scaled steps in its own `modes` (a
    resumed run's rows include earlier jobs', which may have run another precision): the audited
    step's measurements (absent for fp16_master and under FSDP), the scale history of those
    steps, and the recommendation. None without such steps."""
    scaled_modes = {m for m in modes if mode_of(m).scales_loss}
    scaled = [r for r in rows if r.get("precision") in scaled_modes]
    if not scaled:
        return None
    measured = measured or {}
    history = scale_history(scaled)
    advice = recommend(measured, history, grad_scaler)
    return {key: measured.get(key) for key in MEASURED} | history | {"recommendation": advice}


# fp4 health: a share of a tensor's blocks that quantize to all zeros (underflow) or saturate
# worth a warning (a block's scale is set by its largest value: few should clip, few vanish).
FP4_ALARM = 1e-2


def fp4_health(counts: dict, fmt) -> dict:
    """fp16 health's FP4 sibling, from the blocks every FP4 GEMM of the run quantized: per module
    class and tensor (input, weight, grad_output), the share of blocks whose scale saturates (a
    value clipped at E2M1's ±6, the scale clamped at its format's largest, or non-finite) and of
    blocks not all zero whose values all rounded to zero (underflow). `counts`: (class, tensor) →
    [blocks, saturated, underflow] (runner/precision/fp4.py's Recipe)."""
    by_class: dict[str, dict] = {}
    worst = []
    for (kind, tensor), c in sorted(counts.items()):
        blocks, saturated, underflow = (float(v) for v in c.tolist())
        if not blocks:
            continue
        row = {
            "blocks": int(blocks),
            "saturated_share": saturated / blocks,
            "underflow_share": underflow / blocks,
        }
        by_class.setdefault(kind, {})[tensor] = row
        for what in ("saturated", "underflow"):
            if row[f"{what}_share"] > FP4_ALARM:
                worst.append(f"{kind} {tensor}: {row[f'{what}_share']:.1%} of blocks {what}")
    block = f"blocks of {fmt.block}" + (" with an fp32 tensor scale" if fmt.name == "nvfp4" else "")
    if not by_class:
        verdict = "no FP4 GEMM ran"
    elif worst:
        verdict = f"{fmt.name} ({block}) loses blocks: " + "; ".join(worst)
    else:
        verdict = f"{fmt.name} ({block}): under {FP4_ALARM:.0%} of every tensor's blocks saturate or underflow"
    return {"format": fmt.name, "by_class": by_class, "verdict": verdict}
