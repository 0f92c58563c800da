"""runner.max_batch=true: before training, the largest per-device micro-batch that fits a memory
budget, and for token data the longest sequence at the configured batch, found by measurement.
Training then runs as configured: the search changes nothing it does (its runs are throwaway).

A size is measured by a short real run of the config at that size, built and prepared as the
comparison's interleaved timing builds a run (runner/train/session.py, in one process): an
audited step, then one more (the second holds the optimizer state while its activations live).
Its memory is, on CUDA, the peak allocated (torch.cuda.max_memory_allocated); elsewhere the
accounted total of summary.json's `memory` (a CPU process's peak is not one run's).

Three sizes up to the configured one are fitted: static + per-sample (activations grow linearly
in the batch at a fixed sequence length), and for the sequence a quadratic (attention's scores
grow with its square where they are materialised). The largest size the fit allows is then run
for real; where it does not fit (over the budget, out of memory on CUDA, or refused by the model,
e.g. beyond its position table), the search bisects down from it to the largest size that did,
and says so. On a CPU planning for a GPU, a predicted size too large for this host is reported
unconfirmed rather than run.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable
from contextlib import ExitStack

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from runner import console
from runner.config.schema import GPU_MEMORY_GB, MEMORY_MARGIN
from runner.errors import UserError, first_line
from runner.measure.batch_fit import _solve
from runner.measure.memory import MB
from runner.train.session import prepared, trainer_timer, workspace

Measure = Callable[[int], float | str]  # MB a size takes, or why it could not run
FRACTIONS = (0.25, 0.5, 1.0)  # of the configured batch: the sizes the batch fit measures
SEQ_FRACTIONS = (0.5, 0.75, 1.0)  # of the configured sequence (short ones may be refused)


def budget(setting: float | str | None, device: torch.device) -> tuple[float, str]:
    """runner.memory_budget_gb in MB, and where it comes from: a number is GB as given, a GPU's
    name its memory less MEMORY_MARGIN, null the CUDA device's memory less MEMORY_MARGIN."""
    if isinstance(setting, str):
        name = setting.upper()
        gb = GPU_MEMORY_GB[name]
        return gb * 1024 * (1 - MEMORY_MARGIN), f"{name}'s {gb} GB less {MEMORY_MARGIN:.0%}"
    if setting is not None:
        return float(setting) * 1024, f"runner.memory_budget_gb={setting}"
    if device.type != "cuda":
        raise UserError(
            f"runner.max_batch=true on {device.type} needs runner.memory_budget_gb: GB, or a "
            f"GPU's name for its memory less {MEMORY_MARGIN:.0%} ({', '.join(GPU_MEMORY_GB)})"
        )
    props = torch.cuda.get_device_properties(device)
    total = props.total_memory / MB
    source = f"{props.name}'s {total / 1024:.0f} GB less {MEMORY_MARGIN:.0%}"
    return total * (1 - MEMORY_MARGIN), source


def _probe(cfg: DictConfig) -> dict:
    """summary.json's `memory` of two steps of `cfg`, as the interleaved timing runs them."""
    with ExitStack() as stack:
        device, data, task, log = workspace(cfg, stack)
        variant, precision = prepared(cfg, task, device, stack)
        return trainer_timer(cfg, variant, data, precision, log, 1, 1)()["memory"]


def measure(cfg: DictConfig, key: str, size: int) -> float | str:
    """MB a run of `cfg` with dataset.<key>=size takes (CUDA: its peak; else the accounted
    total), or why it could not run: out of memory, or the model's refusal of that size."""
    probe = OmegaConf.merge(
        cfg, {"dataset": {key: size}, "trainer": {"accumulate_grad_batches": 1}}
    )
    try:
        memory = _probe(probe)
        mb = memory["peak"] if memory["peak"] is not None else memory["total"]
    except torch.OutOfMemoryError:
        mb = "out of memory"
    except UserError as e:
        mb = first_line(e)
    # Out of the except clause, the failed run's frames (and tensors) are unreferenced.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return mb


def _fit(points: dict[int, float], degree: int) -> np.ndarray:
    """Least-squares coefficients, lowest order first. A quadratic whose square term bends it
    down or adds under a millionth at the largest size (rounding: attention that saves no
    scores) is refitted as a line, which extrapolates no further than the data shows."""
    coefficients = np.polynomial.polynomial.polyfit(list(points), list(points.values()), degree)
    if degree == 2 and coefficients[2] * max(points) ** 2 <= 1e-6 * max(points.values()):
        return _fit(points, 1)
    return coefficients


def _describe(coefficients: np.ndarray, unit: str) -> str:
    terms = [f"{coefficients[0]:.4g} MB", f"{coefficients[1]:.4g} MB/{unit}"]
    if len(coefficients) > 2:
        terms.append(f"{coefficients[2]:.4g} MB/{unit}²")
    return " + ".join(terms)


def largest(
    measure: Measure,
    sizes: list[int],
    budget_mb: float,
    degree: int,
    unit: str,
    room_mb: float = math.inf,
) -> dict:
    """The largest size whose measured memory is within `budget_mb`: `value` (None where it could
    not be found), `method` (how, in words) and `fit` (the budget, the measured MB by size, the
    fit's coefficients lowest order first). A prediction whose fitted memory exceeds `room_mb`
    (what this host can hold) is not run."""
    points: dict[int, float | str] = {}

    def run(n: int) -> float | str:
        if n not in points:
            points[n] = measure(n)
        return points[n]

    def fits(n: int) -> bool:
        return isinstance(m := run(n), float) and m <= budget_mb

    for n in sizes:
        run(n)
    good = {n: m for n, m in points.items() if isinstance(m, float)}
    # By size as text: summary.json's keys are strings.
    fit = {"budget_mb": budget_mb, "measured_mb": {str(n): m for n, m in good.items()}}
    fit["coefficients_mb"] = None
    measured = ", ".join(map(str, sizes))
    if len(good) <= degree:
        why = next(f"{n}: {m}" for n, m in points.items() if not isinstance(m, float))
        return {"value": None, "method": f"not measured ({unit} {why})", "fit": fit}
    coefficients = _fit(good, degree)
    fit["coefficients_mb"] = coefficients.tolist()
    shown = f"fit of {measured} {unit}s: {_describe(coefficients, unit)}"
    predicted = _solve(coefficients, budget_mb)
    if predicted is None:
        return {"value": None, "method": f"{shown}: no growth to extrapolate", "fit": fit}
    if predicted == 0:
        return {"value": 0, "method": f"{shown}: no room for one {unit}", "fit": fit}
    expected = float(np.polynomial.Polynomial(coefficients)(predicted))
    if expected > room_mb:
        method = f"{shown}; {predicted} predicted, not confirmed (too large for this host)"
        return {"value": predicted, "method": method, "fit": fit}
    if fits(predicted):
        method = f"{shown}; {predicted} predicted and confirmed ({points[predicted]:.4g} MB)"
        return {"value": predicted, "method": method, "fit": fit}
    failure = points[predicted]
    failure = failure if isinstance(failure, str) else f"{failure:.4g} MB, over the budget"
    low = max((n for n in good if n < predicted and good[n] <= budget_mb), default=0)
    high, runs = predicted, 0
    while high - low > 1:
        mid, runs = (low + high) // 2, runs + 1
        low, high = (mid, high) if fits(mid) else (low, mid)
    method = f"{shown}; {predicted} predicted: {failure}; bisected down to {low} ({runs} runs)"
    return {"value": low, "method": method, "fit": fit}


def _room_mb(device: torch.device) -> float:
    """Where a CPU plans: half of this host's free memory (the accounted total leaves out
    temporaries). On CUDA the device itself says when a size does not fit."""
    if device.type == "cuda":
        return math.inf
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / MB / 2
    except (ValueError, OSError, AttributeError):  # no such counter on this system
        return math.inf


def _sizes(configured: int, fractions: tuple[float, ...], degree: int) -> list[int]:
    sizes = sorted({max(1, round(configured * f)) for f in fractions})
    return sizes if len(sizes) > degree else list(range(1, degree + 2))


def search(cfg: DictConfig, device: torch.device, world: int) -> dict:
    """The summary's max_batch, max_batch_method, max_batch_fit, and for token data (a dataset
    with seq_len) max_seq_len, max_seq_len_method, max_seq_len_fit; said on the console."""
    if world > 1:
        raise UserError(
            "runner.max_batch=true measures one process: run it without torchrun (under DDP or "
            "FSDP the memory of a rank differs)"
        )
    budget_mb, source = budget(cfg.runner.memory_budget_gb, device)
    measured = "peak allocated" if device.type == "cuda" else "accounted total"
    knobs = [("batch", "batch_size", "sample", FRACTIONS, 1)]
    if "seq_len" in cfg.dataset:
        knobs.append(("seq_len", "seq_len", "token", SEQ_FRACTIONS, 2))
    summary = {}
    for name, key, unit, fractions, degree in knobs:
        sizes = _sizes(cfg.dataset[key], fractions, degree)
        found = largest(
            lambda n, key=key: measure(cfg, key, n),
            sizes,
            budget_mb,
            degree,
            unit,
            _room_mb(device),
        )
        found["method"] += (
            f"; each run's {measured} against a budget of {budget_mb:.4g} MB ({source})"
        )
        summary |= {
            f"max_{name}": found["value"],
            f"max_{name}_method": found["method"],
            f"max_{name}_fit": found["fit"],
        }
        console.say(f"max {name.replace('_', ' ')}: {found['value']} — {found['method']}")
    return summary
