"""The GPUs' datasheet figures: dense peak TFLOP/s per model and mode, peak memory bandwidth, and
the model a device name denotes (`device_model`). MFU (runner/measure/flops.py) and the
projection (runner/measure/projection.py) divide by them."""

from __future__ import annotations

import re

# Dense (no sparsity) peak TFLOP/s per GPU model and mode. Sources: NVIDIA's product datasheets
# (H100/H200 NVL and HGX B200/GB200 NVL72 tables divided per GPU), the Ampere/Ada/Blackwell
# GeForce whitepapers (FP32-accumulate tensor rates, which PyTorch uses), AWS's A10G figures and
# AMD's MI300X datasheet; sparse-only figures halved. A mode a device lacks is absent.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100 PCIe": {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312},
    "A100 SXM": {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312},
    "H100 PCIe": {"fp32": 51, "tf32": 378, "bf16": 756.5, "fp16": 756.5, "fp8": 1513},
    "H100 SXM": {"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979},
    "H100 NVL": {"fp32": 60, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
    "H200 SXM": {"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979},
    "H200 NVL": {"fp32": 60, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
    "B200": {
        "fp32": 75,
        "tf32": 1125,
        "bf16": 2250,
        "fp16": 2250,
        "fp8": 4500,
        "mxfp8": 4500,
        "nvfp4": 9000,  # HGX B200: FP4 18 PFLOPS sparse per GPU
        "mxfp4": 9000,
    },
    "GB200": {
        "fp32": 80,
        "tf32": 1250,
        "bf16": 2500,
        "fp16": 2500,
        "fp8": 5000,
        "mxfp8": 5000,
        "nvfp4": 10000,  # GB200 NVL72: FP4 1,440 PFLOPS sparse over 72 GPUs
        "mxfp4": 10000,
    },
    "L4": {"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121, "fp8": 242.5},
    "L40": {"fp32": 90.5, "tf32": 90.5, "bf16": 181.05, "fp16": 181.05, "fp8": 362},
    "L40S": {"fp32": 91.6, "tf32": 183, "bf16": 362.05, "fp16": 362.05, "fp8": 733},
    "A10": {"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125},
    "A10G": {"fp32": 35, "tf32": 35, "bf16": 70, "fp16": 70},
    "T4": {"fp32": 8.1, "fp16": 65},
    "V100 PCIe": {"fp32": 14, "fp16": 112},
    "V100 SXM": {"fp32": 15.7, "fp16": 125},
    "RTX 3090": {"fp32": 35.6, "tf32": 35.6, "bf16": 71, "fp16": 71},
    "RTX 4090": {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3},
    "RTX 5090": {"fp32": 104.8, "tf32": 104.8, "bf16": 209.5, "fp16": 209.5, "fp8": 419},
    "MI300X": {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9},
}
# Peak memory bandwidth in TB/s (10**12 bytes/s) per GPU model of GPU_PEAK_TFLOPS, the same
# datasheets: H100 SXM 3.35, PCIe 2.0, NVL 3.9; H200 4.8; A100 80GB SXM 2.039, PCIe 1.935; B200 8
# (torchao's roofline_utils takes 7.67, the bus width CUDA 13 reports); GB200 8; L4 0.3;
# L40/L40S 0.864; A10/A10G 0.6; T4 0.32; V100 0.9; RTX 3090 0.936, 4090 1.008, 5090 1.792;
# MI300X 5.3. The projection (runner/measure/projection.py) divides bytes by these.
GPU_MEMORY_BANDWIDTH_TBS: dict[str, float] = {
    "A100 PCIe": 1.935,
    "A100 SXM": 2.039,
    "H100 PCIe": 2.0,
    "H100 SXM": 3.35,
    "H100 NVL": 3.9,
    "H200 SXM": 4.8,
    "H200 NVL": 4.8,
    "B200": 8.0,
    "GB200": 8.0,
    "L4": 0.3,
    "L40": 0.864,
    "L40S": 0.864,
    "A10": 0.6,
    "A10G": 0.6,
    "T4": 0.32,
    "V100 PCIe": 0.9,
    "V100 SXM": 0.9,
    "RTX 3090": 0.936,
    "RTX 4090": 1.008,
    "RTX 5090": 1.792,
    "MI300X": 5.3,
}
# `torch.cuda.get_device_name()` spells one model many ways ("NVIDIA A100-SXM4-80GB", "NVIDIA
# A100 80GB PCIe"); after normalisation (see `device_model`) the words are looked up exactly here,
# so "L40S" never borrows "L4"'s peak nor "H100 NVL" the SXM part's.
DEVICE_MODELS: dict[str, str] = {model.upper(): model for model in GPU_PEAK_TFLOPS} | {
    "H200": "H200 SXM",  # the NVL card names itself "NVIDIA H200 NVL"
}
_VENDOR_WORDS = {"NVIDIA", "TESLA", "GEFORCE", "AMD", "INSTINCT"}
_MEMORY_WORD = re.compile(r"\d+GB|HBM\d*E?")


def device_model(name: str) -> str | None:
    """The datasheet model a device name denotes, or None when it is not one listed: upper-case,
    "-"/"_" as spaces, vendor words and memory size/type dropped, SXM2/4/5 as SXM, then an exact
    look-up (never a prefix or substring)."""
    words = name.upper().replace("-", " ").replace("_", " ").split()
    memory = [w for w in words if _MEMORY_WORD.fullmatch(w)]
    words = [
        re.sub(r"^SXM\d$", "SXM", w)
        for w in words
        if w not in _VENDOR_WORDS and not _MEMORY_WORD.fullmatch(w)
    ]
    # The SXM5 H100 reports "NVIDIA H100 80GB HBM3" with no form factor; the PCIe card (HBM2e)
    # and the NVL card name theirs, so a bare H100 on HBM3 is the SXM part. Without HBM3 a bare
    # H100 could be any of them: unknown.
    if words == ["H100"] and "HBM3" in memory:
        words.append("SXM")
    return DEVICE_MODELS.get(" ".join(words))
