"""The GPUs the projection (runner/measure/projection.py) knows: their peaks and bandwidth
(runner/measure/peaks.py's tables), the achievable share of each, their memory, the roofline's
other assumptions, and the names a user types for them."""

from __future__ import annotations

from dataclasses import dataclass

from runner.measure.peaks import GPU_MEMORY_BANDWIDTH_TBS, GPU_PEAK_TFLOPS, device_model

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
