"""Measurements of a run: peak memory, throughput statistics, FLOPs and MFU, and the precision
audit (which dtype each op really ran in)."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry


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


def peak_reserved_mb(device: torch.device) -> float | None:
    """CUDA: the caching allocator's peak reservation, what the run held of the GPU (allocated
    plus cached blocks); None elsewhere."""
    return torch.cuda.max_memory_reserved(device) / 2**20 if device.type == "cuda" else None


# Dense peak TFLOP/s by GPU (first matching name wins) and mode: the vendors' datasheet figures
# without sparsity. MFU = achieved / peak; null where the device is not listed.
GPU_PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67}),
    ("H100 PCIe", {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51}),
    ("H100", {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67}),
    ("A100", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
    ("L4", {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30}),
    ("T4", {"fp16": 65, "fp32": 8.1}),
    ("V100", {"fp16": 125, "fp32": 15.7}),
    ("4090", {"bf16": 165, "fp16": 165, "tf32": 82.6, "fp32": 82.6}),
    ("3090", {"bf16": 71, "fp16": 71, "tf32": 35.6, "fp32": 35.6}),
]
LOW_PRECISION = {torch.float16, torch.bfloat16}


class PrecisionAudit(TorchDispatchMode):
    """Records, for one training step, the FLOPs of every op by the dtype it really ran in (after
    autocast's casts): the share done in low precision, and what stayed fp32."""

    def __init__(self):
        super().__init__()
        self.flops: dict[tuple[str, torch.dtype], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FLOP_FORMULAS.get(func._overloadpacket)
        if formula is not None:
            dtype = next(
                (a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()),
                None,
            )
            self.flops[(func._overloadpacket.__name__, dtype)] += int(
                formula(*args, **kwargs, out_val=out)
            )
        return out

    def report(self) -> dict:
        total = sum(self.flops.values())
        low = sum(f for (_, dtype), f in self.flops.items() if dtype in LOW_PRECISION)
        fp32_ops: dict[str, int] = defaultdict(int)
        for (op, dtype), f in self.flops.items():
            if dtype == torch.float32:
                fp32_ops[op] += f
        return {
            "flops_per_step": total,
            "low_precision_flop_share": low / total if total else None,
            "fp32_ops": dict(sorted(fp32_ops.items(), key=lambda item: -item[1])),
        }


def _flop_formulas() -> dict:
    formulas = dict(flop_registry)
    aten = torch.ops.aten
    # The CPU flash-attention kernels take the same leading arguments as the CUDA ones.
    for cpu, cuda in (
        ("_scaled_dot_product_flash_attention_for_cpu", aten._scaled_dot_product_flash_attention),
        (
            "_scaled_dot_product_flash_attention_for_cpu_backward",
            aten._scaled_dot_product_flash_attention_backward,
        ),
    ):
        if hasattr(aten, cpu) and cuda in formulas:
            formulas[getattr(aten, cpu)] = formulas[cuda]
    return formulas


_FLOP_FORMULAS = _flop_formulas()


def peak_tflops(caps, mode: str, cache_dir: Path) -> float | None:
    """The device's peak for the mode: a datasheet table for GPUs; on a CPU a matmul ceiling
    measured once per (CPU, threads, torch, dtype) and cached."""
    if caps.type == "cuda":
        table = next((peaks for name, peaks in GPU_PEAK_TFLOPS if name in caps.name), {})
        return table.get(mode)
    if caps.type != "cpu":
        return None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode, torch.float32)
    key = f"{caps.name}|{torch.get_num_threads()}|{torch.__version__}|{dtype}"
    path = cache_dir / "cpu_peak_tflops.json"
    cached = json.loads(path.read_text()) if path.exists() else {}
    if key not in cached:
        cached[key] = _measure_matmul_tflops(dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    return cached[key]


def _measure_matmul_tflops(dtype: torch.dtype, n: int = 1024, seconds: float = 0.3) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - start) / 1e12


def utilisation(summary: dict, caps, mode: str, cache_dir: Path) -> dict:
    """Achieved TFLOP/s from the audited FLOPs per step and the median step time, and MFU."""
    flops, step_time = summary.get("flops_per_step"), summary.get("step_time_s")
    if not flops or not step_time:
        return {"achieved_tflops": None, "mfu": None}
    achieved = flops / step_time / 1e12
    peak = peak_tflops(caps, mode, cache_dir)
    return {
        "achieved_tflops": achieved,
        "peak_tflops": peak,
        "mfu": achieved / peak if peak else None,
    }
