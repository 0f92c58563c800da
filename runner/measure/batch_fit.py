"""The memory fit's arithmetic: the largest size a fitted memory (static + per-size MB, and a
quadratic term for a sequence) allows within a budget (runner.max_batch solves its fit with it),
and the projection's max batch on a GPU it did not run on (runner/measure/projection.py)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from runner.config.schema import MEMORY_MARGIN

if TYPE_CHECKING:
    from runner.measure.gpus import GpuSpec


def _solve(coefficients: np.ndarray, budget_mb: float) -> int | None:
    """The largest size ≥ 0 whose fitted memory is within the budget; None where the fit does
    not grow with the size (nothing to extrapolate)."""
    poly = np.polynomial.Polynomial(coefficients)
    if coefficients[1:].max() <= 0:
        return None
    a, b, c = (*coefficients, 0.0)[:3]
    if c > 0:
        n = (-b + math.sqrt(max(b * b - 4 * c * (a - budget_mb), 0.0))) / (2 * c)
    else:
        n = (budget_mb - a) / b
    n = max(0, math.floor(n))
    while poly(n + 1) <= budget_mb:  # the closed form's rounding, either way
        n += 1
    while n > 0 and poly(n) > budget_mb:
        n -= 1
    return n


def fitted_max_batch(coefficients: list[float] | None, gpu: GpuSpec) -> int | None:
    """The largest micro-batch whose fitted memory (static + per-sample MB) fits the GPU's
    memory less MEMORY_MARGIN, as runner.max_batch solves it."""
    if not coefficients or gpu.memory_gb is None:
        return None
    budget = gpu.memory_gb * 1024 * (1 - MEMORY_MARGIN)
    return _solve(np.array(coefficients[:2], dtype=float), budget)


def memory_coefficients(summary: dict, micro_batch: int | None) -> tuple[list[float] | None, str]:
    """(static MB, MB per sample) and where they come from: runner.max_batch's fit where the
    run made one, else the run's accounted memory (everything but the activations is static;
    the activations, one micro-batch's, grow with the batch)."""
    fit = (summary.get("max_batch_fit") or {}).get("coefficients_mb")
    if fit and len(fit) >= 2:
        return [fit[0], fit[1]], "runner.max_batch's fit"
    memory = summary.get("memory") or {}
    activations = (memory.get("activations") or {}).get("mb")
    if not activations or not micro_batch or memory.get("total") is None:
        return None, "no memory accounted"
    static = memory["total"] - activations
    return [
        static,
        activations / micro_batch,
    ], "the accounted memory (static + activations per sample)"
