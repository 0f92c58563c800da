"""Measurements of a run: peak memory and throughput statistics."""

from __future__ import annotations

import resource
import statistics
import sys

import torch


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak allocated by tensors. CPU: the process's peak resident set (it cannot be reset,
    so in a multirun it is the peak so far)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def steady_median(values: list[float], warmup: int) -> float | None:
    """Median after the first `warmup` values (kept when nothing else is left)."""
    steady = values[warmup:] or values
    return statistics.median(steady) if steady else None
