"""FLOPs, MFU and the precision audit: what one training step computes, in which dtype each op
really ran (after autocast's casts), and how that compares with the device's peak. Model FLOPs
are the step's arithmetic once (what MFU means in the literature); hardware FLOPs add what
gradient checkpointing computes again in backward (HFU)."""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from runner.files import write_text
from runner.measure.contention import Window
from runner.measure.flop_formulas import flop_formulas
from runner.measure.peaks import GPU_PEAK_TFLOPS, device_model
from runner.precision.layers import recomputing
from runner.precision.modes import Mode, mode_of

# fp8 GEMMs show as float8 inputs of `_scaled_mm` on a GPU (on a CPU torchao emulates them in bf16)
LOW_PRECISION = {
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float4_e2m1fn_x2,  # runner/precision/fp4.py: amp_runner::fp4_mm's packed operands
}


def _computes_in(tensor: torch.Tensor) -> torch.dtype:
    """The dtype an operand computes in. A torchao MXFP8 tensor (`MXTensor`) has the dtype of
    the high-precision tensor it stands for, but holds and multiplies fp8 data (`qdata`)."""
    return getattr(tensor, "qdata", tensor).dtype


class PrecisionAudit(TorchDispatchMode):
    """Records, for one training step, the FLOPs of every op by the dtype it really ran in (after
    autocast's casts): the share done in low precision, and what stayed fp32. The forwards that
    gradient checkpointing recomputes are counted apart: hardware FLOPs, not model FLOPs."""

    def __init__(self, matmuls=None):
        """`matmuls`: the precision manifest's record (runner/measure/manifest.py), which sees
        every op too."""
        super().__init__()
        self.flops: dict[tuple[str, torch.dtype], int] = defaultdict(int)
        self.recomputed = 0
        self.matmuls = matmuls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.matmuls is not None:
            self.matmuls.before()
        out = func(*args, **kwargs)
        formula = _FLOP_FORMULAS.get(func._overloadpacket)
        count = formula(*args, **kwargs, out_val=out) if formula is not None else None
        count = None if count is None else int(count)  # None: no matmul (an elementwise einsum)
        if self.matmuls is not None:
            self.matmuls.observe(func, args, kwargs, out, count)
        if count is not None:
            if recomputing():
                self.recomputed += count
            else:
                # the first floating operand's, a list's included (einsum's operands)
                dtype = next(
                    (
                        _computes_in(a)
                        for a in tree_flatten(args)[0]
                        if isinstance(a, torch.Tensor) and a.is_floating_point()
                    ),
                    None,
                )
                self.flops[(func._overloadpacket.__name__, dtype)] += count
        return out

    def report(self) -> dict:
        """Model FLOPs (`flops_per_step`, and by dtype), and hardware FLOPs: those plus the
        recomputed forwards."""
        total = sum(self.flops.values())
        low = sum(f for (_, dtype), f in self.flops.items() if dtype in LOW_PRECISION)
        fp32_ops: dict[str, int] = defaultdict(int)
        for (op, dtype), f in self.flops.items():
            if dtype == torch.float32:
                fp32_ops[op] += f
        return {
            "flops_per_step": total,
            "hardware_flops_per_step": total + self.recomputed,
            "low_precision_flop_share": low / total if total else None,
            "fp32_ops": dict(sorted(fp32_ops.items(), key=lambda item: -item[1])),
        }


_FLOP_FORMULAS = flop_formulas()
_MEASURED_HERE: dict[tuple[Path, str], dict] = {}  # the peaks this process measured


def peak_tflops(caps, mode: Mode, cache_dir: Path) -> float | None:
    """The device's peak for the mode's arithmetic (`compute`), the highest rate its matmuls
    reach in that dtype: the datasheet table for a GPU model listed exactly (None for any other
    GPU, or an arithmetic it lacks); on a CPU the measured matmul rate (`cpu_matmul_tflops`), and
    for a low-precision dtype (bf16/fp16) at least fp32's.
    Where a CPU emulates them, the kernels compute in fp32 (scalar fallbacks, or fp32's own
    kernels under `precision.cpu_kernels`) and their own square-matmul rate is no ceiling: on
    other layouts they run many times faster (transposed operands: 20 times here), never faster
    than fp32's kernels."""
    if caps.type == "cuda":
        model = device_model(caps.name)
        return GPU_PEAK_TFLOPS[model].get(mode.compute) if model else None
    rate = cpu_matmul_tflops(caps, mode, cache_dir)
    if rate is None or mode.low_dtype is None:
        return rate
    return max(rate, _cpu_matmul_tflops(caps, torch.float32, cache_dir))


def cpu_matmul_tflops(caps, mode: Mode, cache_dir: Path) -> float | None:
    """On a CPU, the rate of n×n matmuls in the mode's dtype (its `low_dtype`, else fp32: tf32
    too), measured once per (CPU, threads, torch, dtype) and cached with those conditions; None
    elsewhere and for converted Linears (no CPU kernels: they are emulated)."""
    if caps.type != "cpu" or mode.converts:
        return None
    return _cpu_matmul_tflops(caps, mode.low_dtype or torch.float32, cache_dir)


def _cpu_matmul_tflops(caps, dtype: torch.dtype, cache_dir: Path) -> float:
    return _cpu_peak(caps, dtype, cache_dir)["tflops"]


def _cpu_peak(caps, dtype: torch.dtype, cache_dir: Path) -> dict:
    """The cache's entry for this CPU, threads, torch and dtype, measured where it has none, or
    where it was measured while other processes held the cores (`contended`: measured again)."""
    key = f"{caps.name}|{torch.get_num_threads()}|{torch.__version__}|{dtype}"
    path = cache_dir / "cpu_peak_tflops.json"
    cached = _read_cache(path)
    entry = cached.get(key)
    if (path, key) in _MEASURED_HERE:  # contended or not: once a process
        return _MEASURED_HERE[path, key]
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("tflops"), int | float)
        or entry.get("contended")
    ):
        # Missing, a bare float from before the conditions were recorded, or contended: measure.
        entry = cached[key] = {
            "cpu": caps.name,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "dtype": str(dtype).removeprefix("torch."),
            **_measure_matmul_tflops(dtype),
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        write_text(path, json.dumps(cached, indent=1))
        _MEASURED_HERE[path, key] = entry
    return entry


def contended_peak(caps, mode: Mode, cache_dir: Path) -> float | None:
    """On a CPU, where the matmul peak of `mode` (`peak_tflops`: its dtype's, and fp32's for a
    low-precision one) was measured while other processes held the cores: the least CPU share
    its timings had; else None."""
    if caps.type != "cpu" or mode.converts:
        return None
    dtypes = {mode.low_dtype or torch.float32, torch.float32}
    entries = [_cpu_peak(caps, d, cache_dir) for d in dtypes]
    shares = [e.get("cpu_share") or 0.0 for e in entries if e.get("contended")]
    return min(shares) if shares else None


def emulation_slowdown(caps, mode: Mode, cache_dir: Path) -> float | None:
    """On a CPU that only emulates `mode`'s low-precision matmuls: how many times slower they run
    than fp32's (the cached rates, measured once per machine)."""
    if (
        caps.type != "cpu"
        or mode.low_dtype is None
        or mode.converts
        or caps.support(mode.compute)[0]
    ):
        return None
    low = cpu_matmul_tflops(caps, mode, cache_dir)
    return _cpu_matmul_tflops(caps, torch.float32, cache_dir) / low if low else None


def _read_cache(path: Path) -> dict:
    """The cache file's entries; an unreadable file counts as empty (it is only a cache)."""
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def _measure_matmul_tflops(
    dtype: torch.dtype, n: int = 1024, runs: int = 5, seconds: float = 0.1, budget_s: float = 2.0
) -> dict:
    """The best of `runs` timed stretches of n×n matmuls after a warm-up: the best, not the mean,
    because a ceiling is what the CPU reaches when nothing else interferes. Where one matmul is
    slower than a stretch (emulated bf16/fp16 takes seconds), it stops after two runs once
    `budget_s` is spent; the entry records how many it did."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # the first call pays for thread-pool start-up and kernel selection
    rates: list[float] = []
    shares: list[dict] = []  # what each run got of the machine (runner/measure/contention.py)
    spent = 0.0
    while len(rates) < runs and (len(rates) < 2 or spent < budget_s):
        count, start, window = 0, time.perf_counter(), Window()
        while (elapsed := time.perf_counter() - start) < seconds or not count:
            a @ b
            count += 1
        rates.append(2 * n**3 * count / elapsed / 1e12)
        shares.append(window.read())
        spent += elapsed
    # A run that shared its cores is no ceiling: the clean runs' best, else contended.
    clean = [r for r, s in zip(rates, shares, strict=True) if not s["contended"]] or rates
    cpu = [s["cpu_share"] for s in shares if s["cpu_share"] is not None]
    return {
        "tflops": max(clean),
        "median_tflops": statistics.median(clean),
        "contended": all(s["contended"] for s in shares),
        "cpu_share": max(cpu, default=None),
        "runs": len(rates),
        "seconds_per_run": seconds,
        "n": n,
    }


def utilisation(summary: dict, caps, mode: Mode, cache_dir: Path) -> dict:
    """Achieved TFLOP/s (model FLOPs over the median step time); `mfu` (model FLOPs) and `hfu`
    (hardware FLOPs: with the recomputed forwards) against the peak of `mode` (`peak_mode`: its
    compute); a mode with `mfu_also_vs` (fp8's: bf16) also gets `mfu_vs_<it>_peak` and
    `mfu_vs_mode_peak`. Without a peak for the device and mode, or
    where the step ran faster than the peak (`above_peak`: the peak is no ceiling), MFU and HFU
    are None and `peak_note` says why."""
    flops, step_time = summary.get("flops_per_step"), summary.get("step_time_s")
    if not flops or not step_time:
        return {"achieved_tflops": None, "mfu": None, "hfu": None}
    achieved = flops / step_time / 1e12
    hardware = (summary.get("hardware_flops_per_step") or flops) / step_time / 1e12
    peak = peak_tflops(caps, mode, cache_dir)
    out = {"achieved_tflops": achieved, "peak_tflops": peak, "peak_mode": mode.compute}
    shared = contended_peak(caps, mode, cache_dir) if peak else None
    if summary.get("speed_contended") or shared is not None:
        what = (
            f"the {mode.compute} peak was measured while other processes held the cores "
            f"({shared:.0%} of its threads' CPU; measured again next run)"
            if shared is not None
            else "the run's speed was contended"
        )
        out |= {"mfu": None, "hfu": None, "peak_note": f"{what}: MFU left out"}
        out["peak_contended"] = shared is not None  # a comparison's MFU leaves it out too
    elif not peak:
        out |= {"mfu": None, "hfu": None, "peak_note": _no_peak_note(caps, mode.compute)}
    elif hardware > peak:
        out |= {
            "mfu": None,
            "hfu": None,
            "above_peak": hardware / peak,
            "peak_note": (
                f"the step ran at {hardware:.3g} TFLOP/s, {hardware / peak:.0%} of the {mode.compute} "
                f"peak ({peak:.3g} TFLOP/s): that peak is not this device's ceiling (a bug, or a "
                "CPU measured while busy); MFU left out"
            ),
        }
    else:
        out |= {"mfu": achieved / peak, "hfu": hardware / peak}
    if also := mode.mfu_also_vs:
        # torchtitan and most papers divide an fp8 run by the bf16 peak, llm-foundry by fp8's.
        # Against bf16's it can exceed 1: fp8 GEMMs run up to twice as fast. Only where the
        # device has the mode's own peak: elsewhere (a CPU) fp8 is emulated and neither is a
        # ceiling.
        other = peak_tflops(caps, mode_of(also), cache_dir) if peak else None
        out |= {
            f"mfu_vs_{also}_peak": achieved / other if other else None,
            "mfu_vs_mode_peak": out["mfu"],
        }
    return out


def _no_peak_note(caps, mode: str) -> str:
    if caps.type == "cuda" and (model := device_model(caps.name)):
        return f"{caps.name} ({model}) has no {mode} datasheet peak: MFU left out"
    if caps.type == "cuda":
        return f"no datasheet peak for {caps.name}: MFU left out"
    if caps.type == "cpu":
        return f"no {mode} matmul ceiling is measured on a CPU: MFU left out"
    return f"no peak known for {caps.type} devices: MFU left out"
