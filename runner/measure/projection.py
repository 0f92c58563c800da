"""The projection: what a step of this run would take on a GPU it did not run on, estimated from
what its audited step recorded (runner/measure/manifest.py: every matmul's shape, direction and
format, and the bytes every other op moved), never measured. A roofline, op by op:

- a matmul: max(FLOPs / (the GPU's peak in the format it computes in × ACHIEVABLE's GEMM
  fraction), bytes / (its memory bandwidth × ACHIEVABLE's bandwidth fraction), a kernel launch);
  bytes are its operands at the format's width (a 4-bit or MX format's block scales too) and its
  output at 2 bytes (4 in fp32/tf32), as torchao's roofline counts them;
- any other op: the bytes it read and wrote (at the dtypes it ran in on this machine) over the
  bandwidth, at least a launch per call;
- a Linear converted to fp8/mxfp8/fp4: its observed casts are dropped and replaced by the
  quantization traffic torchao's roofline models for its recipe (amax, casts, the transposed
  copies; `torchao.testing.training.roofline_utils.get_tensor_memory_traffic_ovhd_s`, unfused).

Every assumption is in runner/measure/gpus.py's ASSUMPTIONS block. What it leaves out: the host
(Python, launch queueing: a small model on a GPU is often CPU-bound, which makes every precision
look alike), kernel fusion (torch.compile fuses elementwise ops: the projection is eager's), and
communication. It was never checked against a GPU here (scripts/gpu_check.sh does that)."""

from __future__ import annotations

import math

from runner.measure.batch_fit import fitted_max_batch, memory_coefficients
from runner.measure.gpus import (
    FORMAT_BYTES,
    KERNEL_FLOOR_S,
    LOW_FORMATS,
    SCALE_BLOCK,
    GpuSpec,
    spec,
)
from runner.precision.modes import mode_of


def _floor() -> float:
    try:
        from torchao.testing.training.roofline_utils import KERNEL_LAUNCH_OVERHEAD_SEC
    except ImportError:
        return KERNEL_FLOOR_S
    return KERNEL_LAUNCH_OVERHEAD_SEC


def gpu_format(record: dict, mode) -> str:
    """The format a recorded matmul computes in on a GPU: a scaled low format where its operands
    are one; else its operands' half dtype (what this CPU may have computed in fp32:
    precision.cpu_kernels=fast, PyTorch's CPU attention); else fp32, tf32 where the mode sets it."""
    inputs = record["inputs"]
    for low in LOW_FORMATS:
        if record["format"] == low or any(i.startswith(low) for i in inputs):
            return low
    if record["format"] in ("bf16", "fp16"):
        return record["format"]
    half = next((i for i in inputs if i in ("bf16", "fp16")), None)
    if half:
        return half
    return "tf32" if mode.tf32 else "fp32"


def matmul_time(flops: float, read_elems: float, write_elems: float, fmt: str, gpu: GpuSpec):
    """One matmul call: (seconds, bound) with bound 'compute', 'memory' or 'launch'; None where
    the GPU has no units for `fmt`."""
    peak = gpu.peaks.get(fmt)
    if peak is None and fmt == "tf32":
        peak = gpu.peaks.get("fp32")
    if peak is None:
        return None
    reads = read_elems * (1 + 1 / SCALE_BLOCK[fmt]) if fmt in SCALE_BLOCK else read_elems
    moved = reads * FORMAT_BYTES[fmt] + write_elems * (4 if fmt in ("fp32", "tf32") else 2)
    compute = flops / (peak * 1e12 * gpu.gemm_fraction)
    memory = moved / (gpu.bandwidth * gpu.bandwidth_fraction)
    floor = _floor()
    t = max(compute, memory, floor)
    return t, ("compute" if t == compute else "memory" if t == memory else "launch")


def _recipe(records: list[dict], fmt: str) -> tuple[str | None, str | None]:
    """(float8 recipe, mx recipe) torchao's roofline names for a converted Linear's records."""
    if fmt == "fp8":
        inputs = {i for r in records for i in r["inputs"]}
        if not any("rowwise" in i for i in inputs):
            return "tensorwise", None
        grads = [r for r in records if r["direction"] == "weight_grad"]
        high = grads and all(not any(i.startswith("fp8") for i in r["inputs"]) for r in grads)
        return ("rowwise_with_gw_hp" if high else "rowwise"), None
    return None, {"mxfp8": "mxfp8_cublas", "mxfp4": "mxfp4_cutlass", "nvfp4": "mxfp4_cutlass"}[fmt]


def quantization_time(mkn: list[int], records: list[dict], fmt: str, gpu: GpuSpec) -> float:
    """torchao's roofline of casting a converted Linear's input, weight and output gradient (one
    forward and backward, unfused: its float8_roofline.py default). NVFP4, which torchao's
    training roofline does not cover, is modelled as MXFP4's casts plus a read of each tensor for
    its tensor-wide amax (the second-level scale)."""
    from torchao.testing.training.roofline_utils import get_tensor_memory_traffic_ovhd_s

    m, k, n = mkn
    float8, mx = _recipe(records, fmt)
    specs = gpu.torchao_specs()
    total = 0.0
    for dims, role in (((m, k), "input"), ((k, n), "weight"), ((m, n), "grad_output")):
        kernels = get_tensor_memory_traffic_ovhd_s(specs, *dims, role, float8, mx, False)
        total += sum(float(t) for t in kernels)
        if fmt == "nvfp4":
            amax = 2 * dims[0] * dims[1] / (gpu.bandwidth * gpu.bandwidth_fraction)
            total += max(amax, _floor())
    return total


def project_stage(stage: dict, gpu: GpuSpec) -> dict:
    """One audited step (manifest's {mode, step, ops, traffic}) on `gpu`: `step_time_s` and its
    parts (`matmul_s`, `other_s`, `quantization_s`), the share of matmul time that is
    memory-bound, FLOPs; `step_time_s` None with `why` where a matmul's format has no units on
    that GPU."""
    mode = mode_of(stage["mode"])
    traffic = stage.get("traffic")
    if traffic is None:
        return {"step_time_s": None, "why": "no traffic recorded for the audited step"}
    by_module: dict[str, list[dict]] = {}
    converted: dict[str, str] = {}
    matmul_s = memory_bound = 0.0
    flops = 0
    for r in traffic["matmuls"]:
        fmt = gpu_format(r, mode)
        if fmt in LOW_FORMATS and r["class"] not in ("-",):
            converted[r["module"]] = fmt
        by_module.setdefault(r["module"], []).append(r)
        calls = r["calls"]
        numels = r["operand_numels"]
        timed = matmul_time(r["flops"] / calls, sum(numels), r["out_numel"], fmt, gpu)
        if timed is None:
            return {
                "step_time_s": None,
                "why": f"{gpu.name} has no {fmt} units ({r['module'] or 'the model'}'s {r['op']})",
            }
        t, bound = timed
        matmul_s += t * calls
        memory_bound += t * calls if bound != "compute" else 0.0
        if r["direction"] != "recompute":
            flops += r["flops"]
    quantization_s = 0.0
    for module, fmt in converted.items():
        records = by_module[module]
        forward = [r for r in by_module[module] if r["direction"] == "forward" and r["mkn"]]
        for r in forward:
            quantization_s += r["calls"] * quantization_time(r["mkn"], records, fmt, gpu)
    other_s = 0.0
    bandwidth = gpu.bandwidth * gpu.bandwidth_fraction
    for o in traffic["other"]:
        if o["module"] in converted:
            continue  # its casts, amax and bias: torchao's model of them is quantization_s
        other_s += max(o["bytes"] / bandwidth, o["calls"] * _floor())
    step = matmul_s + other_s + quantization_s
    return {
        "step_time_s": step,
        "matmul_s": matmul_s,
        "other_s": other_s,
        "quantization_s": quantization_s,
        "memory_bound_matmul_share": memory_bound / matmul_s if matmul_s else None,
        "flops_per_step": flops,
        "converted_linears": len(converted),
    }


def project(runs: dict[str, dict], gpus: list[str]) -> dict:
    """summary.json's `projection`: {gpu: {precision: {step_time_s, tokens_per_s, mfu,
    speedup_vs_bf16, speedup_vs_fp32, max_batch, ...}}} for `runs`, {precision: {stage (the last
    audited step of that precision), tokens_per_step, samples_per_step, memory coefficients}}."""
    out: dict = {}
    for name in gpus:
        gpu = spec(name)
        rows: dict[str, dict] = {}
        for precision, run in runs.items():
            stage = run["stage"]
            row = project_stage(stage, gpu)
            t = row["step_time_s"]
            mode = mode_of(stage["mode"])
            peak = gpu.peaks.get(mode.compute)
            coefficients = run.get("memory_coefficients")
            row |= {
                "tokens_per_s": run["tokens_per_step"] / t
                if t and run.get("tokens_per_step")
                else None,
                "samples_per_s": run["samples_per_step"] / t
                if t and run.get("samples_per_step")
                else None,
                "mfu": row.get("flops_per_step", 0) / t / (peak * 1e12) if t and peak else None,
                "peak_mode": mode.compute,
                "max_batch": fitted_max_batch(coefficients, gpu),
                "max_batch_from": run.get("memory_source"),
            }
            if mode.converts and t and not row.get("converted_linears"):  # bf16 by another name
                words = run.get("nothing_converted") or "converted no Linear in its audited step"
                row["nothing_converted"] = f"{precision} {words}"
            if mode.mfu_also_vs and t and (other := gpu.peaks.get(mode.mfu_also_vs)):
                row[f"mfu_vs_{mode.mfu_also_vs}_peak"] = row["flops_per_step"] / t / (other * 1e12)
            rows[precision] = row
        for row in rows.values():
            for ref in ("bf16", "fp32"):
                base = rows.get(ref, {}).get("step_time_s")
                t = row["step_time_s"]
                row[f"speedup_vs_{ref}"] = base / t if base and t else None
        out[gpu.name] = rows | {
            "_assumptions": {
                "peaks_tflops": gpu.peaks,
                "bandwidth_tbs": gpu.bandwidth / 1e12,
                "gemm_fraction": gpu.gemm_fraction,
                "bandwidth_fraction": gpu.bandwidth_fraction,
                "fractions_from": gpu.source,
                "memory_gb": gpu.memory_gb,
                "estimate": "projected from this run's audited step, never measured on this GPU",
            }
        }
    return out


def run_entry(summary: dict, stage: dict, micro_batch: int | None, row: dict | None = None) -> dict:
    """What `project` needs of one run: its last audited step, tokens and samples per optimizer
    step (a logged row's throughput × its step time, the summary's where no row is given), its
    memory coefficients."""
    source = row or summary
    step_time = source.get("step_time_s")
    per_step = {
        f"{kind}_per_step": source[f"{kind}_per_s"] * step_time
        if step_time and source.get(f"{kind}_per_s")
        else None
        for kind in ("tokens", "samples")
    }
    coefficients, source = memory_coefficients(summary, micro_batch)
    return {
        "stage": stage,
        **per_step,
        "memory_coefficients": coefficients,
        "memory_source": source,
        "nothing_converted": (summary.get("converted") or {}).get("nothing_converted"),
    }


def crossover(points: list[tuple[float, float | None]]) -> float | None:
    """The first swept value at which a speedup passes 1.0× (points sorted by value), None if
    none does."""
    for value, speedup in sorted(points):
        if speedup is not None and speedup > 1.0:
            return value
    return None


def table(projection: dict) -> list[list[str]]:
    """Rows for the console: GPU, precision, projected step time, tokens/s, MFU, speedups,
    max batch, what bounds it."""
    rows = [
        ["GPU", "precision", "step (est.)", "tokens/s", "MFU", "vs bf16", "vs fp32", "max batch"]
    ]
    for gpu, precisions in projection.items():
        for precision, r in precisions.items():
            if precision.startswith("_"):
                continue
            t = r.get("step_time_s")
            rows.append(
                [
                    gpu,
                    precision,
                    f"{t * 1e3:.3g} ms" if t else f"— ({r.get('why', '')})",
                    f"{r['tokens_per_s']:.3g}" if r.get("tokens_per_s") else "—",
                    f"{r['mfu']:.1%}" if r.get("mfu") is not None else "—",
                    _x(r.get("speedup_vs_bf16")) + ("*" if r.get("nothing_converted") else ""),
                    _x(r.get("speedup_vs_fp32")),
                    str(r["max_batch"]) if r.get("max_batch") is not None else "—",
                ]
            )
    return rows


def notes(projection: dict) -> list[str]:
    """The lines under the table: each precision marked * converted no Linear, and why."""
    said = {
        r["nothing_converted"]: None
        for precisions in projection.values()
        for r in precisions.values()
        if isinstance(r, dict) and r.get("nothing_converted")
    }
    return [f"* {words}" for words in said]


def _x(value: float | None) -> str:
    return f"{value:.2f}×" if value is not None and math.isfinite(value) else "—"
