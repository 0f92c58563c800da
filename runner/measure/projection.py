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

Every assumption is in this module's ASSUMPTIONS block. What it leaves out: the host (Python,
launch queueing: a small model on a GPU is often CPU-bound, which makes every precision look
alike), kernel fusion (torch.compile fuses elementwise ops: the projection is eager's), and
communication. It was never checked against a GPU here (scripts/gpu_check.sh does that)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from runner.measure.flops import GPU_MEMORY_BANDWIDTH_TBS, GPU_PEAK_TFLOPS, device_model
from runner.precision.modes import mode_of

# --- ASSUMPTIONS: the one place the projection's estimates come from -------------------------
# Achievable share of each GPU's datasheet peaks: (GEMM TFLOP/s, memory bandwidth, source).
# torchao's roofline_utils measured 0.78 and 0.92 on an H100 (large GEMMs; large pointwise
# Triton kernels) and copies them to B200/GB200/MI300X; it measured 0.82 and 0.84 on a B300.
# Nothing here has been measured: scripts/gpu_check.sh prints projected against measured step
# time so these can be corrected from a real run.
ACHIEVABLE: dict[str, tuple[float, float, str]] = {
    "H100 SXM": (0.78, 0.92, "torchao roofline_utils, measured on an H100"),
    "H100 PCIe": (0.78, 0.92, "torchao's H100 figures, copied"),
    "H100 NVL": (0.78, 0.92, "torchao's H100 figures, copied"),
    "H200 SXM": (0.78, 0.92, "torchao's H100 figures, copied"),
    "B200": (0.78, 0.92, "torchao's H100 figures, copied (as torchao does)"),
    "GB200": (0.78, 0.92, "torchao's H100 figures, copied (as torchao does)"),
}
DEFAULT_ACHIEVABLE = (0.78, 0.92, "torchao's H100 figures, copied: never measured on this GPU")
# A kernel's least time: torchao's KERNEL_LAUNCH_OVERHEAD_SEC (a one-element Triton kernel on an
# H100), charged once per call of every op.
KERNEL_FLOOR_S = 2e-6
# Bytes per element a matmul reads its operands in, by the format it computes in.
FORMAT_BYTES = {
    "fp32": 4,
    "tf32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "mxfp8": 1,
    "nvfp4": 0.5,
    "mxfp4": 0.5,
}
SCALE_BLOCK = {"mxfp8": 32, "mxfp4": 32, "nvfp4": 16}  # one 1-byte scale per block of operands
LOW_FORMATS = ("mxfp8", "fp8", "nvfp4", "mxfp4")  # torchao's scaled formats (checked in order)
# Memory each GPU has, in GB as its maker states it (runner.memory_budget_gb's names and a few
# more); the budget leaves out MEMORY_MARGIN as runner.max_batch does.
GPU_MEMORY_GB = {
    "A100 PCIe": 80,
    "A100 SXM": 80,
    "H100 PCIe": 80,
    "H100 SXM": 80,
    "H100 NVL": 94,
    "H200 SXM": 141,
    "H200 NVL": 141,
    "B200": 180,
    "GB200": 186,
    "L4": 24,
    "L40": 48,
    "L40S": 48,
    "A10": 24,
    "A10G": 24,
    "T4": 16,
    "V100 PCIe": 32,
    "V100 SXM": 32,
    "RTX 3090": 24,
    "RTX 4090": 24,
    "RTX 5090": 32,
    "MI300X": 192,
}
# Short names a user types: the part most people mean.
ALIASES = {"H100": "H100 SXM", "H200": "H200 SXM", "A100": "A100 SXM", "V100": "V100 SXM"}
# --- end of ASSUMPTIONS ------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuSpec:
    """What the projection knows of a GPU: its peaks (TFLOP/s by format), bandwidth (bytes/s),
    the achievable fractions of both, its memory (GB) and where the fractions come from."""

    name: str
    peaks: dict
    bandwidth: float
    gemm_fraction: float
    bandwidth_fraction: float
    memory_gb: float | None
    source: str

    def torchao_specs(self) -> dict:
        """The spec dict torchao's roofline functions take."""
        return {
            "peak_mem_bw_bytes_sec": self.bandwidth,
            "pct_achievable_mem_bw": self.bandwidth_fraction,
        }


def gpu_names(setting) -> list[str]:
    """runner.project's GPUs: a name, a list of them, or 'all'; each resolved to the peak
    table's model name (H100 → H100 SXM)."""
    if setting in (None, False, "", []):
        return []
    if isinstance(setting, str):
        setting = list(GPU_PEAK_TFLOPS) if setting.lower() == "all" else [setting]
    out = []
    for name in setting:
        resolved = resolve(str(name))
        if resolved not in out:
            out.append(resolved)
    return out


def resolve(name: str) -> str:
    from runner.errors import UserError

    key = name.strip()
    if key.upper() in (a.upper() for a in ALIASES):
        return next(v for a, v in ALIASES.items() if a.upper() == key.upper())
    for model in GPU_PEAK_TFLOPS:
        if model.upper() == key.upper().replace("-", " ").replace("_", " "):
            return model
    if model := device_model(key):
        return model
    raise UserError(
        f"runner.project: no GPU {name!r} in the peak table ({', '.join([*ALIASES, *GPU_PEAK_TFLOPS])}, or all)"
    )


def spec(name: str) -> GpuSpec:
    model = resolve(name)
    gemm, bandwidth, source = ACHIEVABLE.get(model, DEFAULT_ACHIEVABLE)
    return GpuSpec(
        name=model,
        peaks=GPU_PEAK_TFLOPS[model],
        bandwidth=GPU_MEMORY_BANDWIDTH_TBS[model] * 1e12,
        gemm_fraction=gemm,
        bandwidth_fraction=bandwidth,
        memory_gb=GPU_MEMORY_GB.get(model),
        source=source,
    )


def torchao_spec(name: str = "NVIDIA H100") -> GpuSpec:
    """A GPU as torchao's roofline_utils describes it (its peaks, bandwidth and fractions): the
    cross-check against torchao's own estimate uses it, so that only the model is compared."""
    from torchao.testing.training.roofline_utils import gpu_name_to_specs

    s = gpu_name_to_specs[name]
    peaks = {"bf16": s["bf16_peak_tops"] / 1e12, "fp8": s["fp8_peak_tops"] / 1e12}
    if "fp4_peak_tops" in s:
        peaks |= {"nvfp4": s["fp4_peak_tops"] / 1e12, "mxfp4": s["fp4_peak_tops"] / 1e12}
        peaks["mxfp8"] = peaks["fp8"]
    return GpuSpec(
        name=f"{name} (torchao's)",
        peaks=peaks,
        bandwidth=s["peak_mem_bw_bytes_sec"],
        gemm_fraction=s.get("pct_achievable_gemm_tops", DEFAULT_ACHIEVABLE[0]),
        bandwidth_fraction=s.get("pct_achievable_mem_bw", DEFAULT_ACHIEVABLE[1]),
        memory_gb=None,
        source="torchao roofline_utils",
    )


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


def fitted_max_batch(coefficients: list[float] | None, gpu: GpuSpec) -> int | None:
    """The largest micro-batch whose fitted memory (static + per-sample MB) fits the GPU's
    memory less MEMORY_MARGIN, as runner.max_batch solves it."""
    import numpy as np

    from runner.answers.max_batch import _solve
    from runner.config.schema import MEMORY_MARGIN

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
                    _x(r.get("speedup_vs_bf16")),
                    _x(r.get("speedup_vs_fp32")),
                    str(r["max_batch"]) if r.get("max_batch") is not None else "—",
                ]
            )
    return rows


def _x(value: float | None) -> str:
    return f"{value:.2f}×" if value is not None and math.isfinite(value) else "—"
