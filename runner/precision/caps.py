"""What a device can do natively, as far as precision is concerned, and the mode `auto` picks."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from runner.errors import UserError

# The compute capability from which a GPU's tensor cores run each arithmetic (mxfp8: Blackwell)
FP4 = ("nvfp4", "mxfp4")
TENSOR_CORES = {"tf32": (8, 0), "bf16": (8, 0), "fp16": (7, 0), "fp8": (8, 9), "mxfp8": (10, 0)}

# The CPU kinds the project runs on, by the flags /proc/cpuinfo gives them (those that decide a
# precision's kernels). AMP_RUNNER_CPU_KIND=<kind> makes a process see that kind's flags, whatever
# its CPU: to see what another machine's `auto` picks, and so that tests set the kind they test.
CPU_KIND_ENV = "AMP_RUNNER_CPU_KIND"
CPU_KINDS = {
    "avx2": frozenset({"avx2", "fma"}),  # AMD EPYC before Zen 4: bf16 and fp16 emulated
    "avx512_bf16": frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}),  # Zen 5: bf16 native
    # Intel Xeon with AMX: bf16 and fp16 native
    "amx": frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16"}),
}


@dataclass(frozen=True)
class DeviceCaps:
    """What a device can do natively, as far as precision is concerned."""

    type: str  # "cpu" | "cuda" | "mps"
    name: str
    cuda_capability: tuple[int, int] | None = None
    cpu_flags: frozenset[str] = frozenset()

    @classmethod
    def probe(cls, device: torch.device) -> DeviceCaps:
        if device.type == "cuda":
            return cls(
                "cuda",
                torch.cuda.get_device_name(device),
                cuda_capability=torch.cuda.get_device_capability(device),
            )
        if device.type == "cpu":
            return cls("cpu", _cpu_name(), cpu_flags=_cpu_flags())
        return cls(device.type, device.type)

    def support(self, mode: str) -> tuple[bool, str]:
        """(native, why) for an arithmetic (a mode's `compute`) on this device."""
        if mode == "fp32":
            return True, "fp32 runs everywhere"
        if mode in FP4:  # no FP4 kernels are wired: runner/precision/fp4.py emulates them
            return False, f"{mode} matmuls are emulated here (quantized, dequantized, fp32)"
        if self.type == "cuda":
            cc = self.cuda_capability or (0, 0)
            need = TENSOR_CORES[mode]
            ok = cc >= need
            return ok, (
                f"{self.name} has compute capability {cc[0]}.{cc[1]}; "
                f"{mode} tensor cores need ≥ {need[0]}.{need[1]}"
            )
        if self.type == "cpu":
            if mode == "tf32":
                return False, "CPUs have no TF32 units: tf32 matmuls run as fp32"
            if mode in ("fp8", "mxfp8"):
                return False, f"CPUs have no {mode} units: torchao emulates {mode} matmuls"
            flags = {"bf16": ("amx_bf16", "avx512_bf16"), "fp16": ("amx_fp16", "avx512_fp16")}[mode]
            found = [f for f in flags if f in self.cpu_flags]
            if found:
                return True, f"CPU has {', '.join(f.upper() for f in found)}"
            return False, f"CPU lacks {' and '.join(f.upper() for f in flags)}: {mode} is emulated"
        return mode in ("fp16", "bf16"), f"{self.type} autocast"  # fp8, mxfp8: no emulation there

    def best_mode(self) -> tuple[str, str]:
        """The mode `auto` picks: bf16 (no loss scaling needed) > fp16 > fp32."""
        candidates = ("bf16", "fp16") if self.type == "cuda" else ("bf16",)
        for mode in candidates:
            native, why = self.support(mode)
            if native:
                return mode, why
        return "fp32", f"no native low-precision support on {self.name}"


def _cpuinfo(prefix: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def forced_cpu_kind() -> str | None:
    """The kind AMP_RUNNER_CPU_KIND names, None where it is unset or `native` (this CPU's own)."""
    kind = os.environ.get(CPU_KIND_ENV, "native")
    if kind == "native":
        return None
    if kind not in CPU_KINDS:
        raise UserError(
            f"{CPU_KIND_ENV}={kind} is not a CPU kind: use one of {', '.join(CPU_KINDS)} or native"
        )
    return kind


def _cpu_flags() -> frozenset[str]:
    kind = forced_cpu_kind()
    return CPU_KINDS[kind] if kind else frozenset((_cpuinfo("flags") or "").split())


def _cpu_name() -> str:
    name = _cpuinfo("model name") or "CPU"
    kind = forced_cpu_kind()
    return f"{name} (as {kind}: {CPU_KIND_ENV})" if kind else name


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise UserError(
                f"trainer.device={name} but CUDA is not available here (torch {torch.__version__}, "
                f"{built}); use trainer.device=cpu or auto"
            )
        device = torch.device(name)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(
                f"trainer.device={name} but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
        return device
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError(
            "trainer.device=mps but MPS is not available here; use trainer.device=cpu or auto"
        )
    return torch.device(name)
