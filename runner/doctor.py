"""`python -m runner.doctor`: what this machine can do for each precision, and which to use."""

from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from runner.errors import UserError, fail
from runner.measure.flops import cpu_matmul_tflops, peak_tflops
from runner.precision import MODES, DeviceCaps, Mode

CPU_FLAGS = ("amx_bf16", "amx_fp16", "avx512_bf16", "avx512_fp16", "avx512f", "avx2")


def devices() -> list[torch.device]:
    found = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return found + [torch.device("cpu")]


def report(device: torch.device, cache_dir: Path) -> Table:
    caps = DeviceCaps.probe(device)
    table = Table(title=f"{device}: {caps.name}", title_justify="left")
    for column in ("mode", "native", "why", "peak TFLOP/s"):
        table.add_column(column)
    arithmetics: dict[str, Mode] = {}  # each arithmetic once, by its first mode's facts
    for m in MODES.values():
        arithmetics.setdefault(m.compute, m)
    rates = {}
    for compute, m in arithmetics.items():
        native, why = caps.support(compute)
        peak = peak_tflops(caps, m, cache_dir)
        rates[compute] = rate = cpu_matmul_tflops(caps, m, cache_dir)
        shown = "—" if peak is None else f"{peak:.2f}"
        if rate is not None:  # a CPU's: measured, and for an emulated mode fp32's ceiling
            shown += " (measured)" if rate == peak else f" (fp32's; its own matmuls: {rate:.3g})"
        table.add_row(compute, "yes" if native else "no (emulated)", why, shown)
    slower = [  # a CPU's low-precision matmuls against its fp32 ones
        c for c, m in arithmetics.items() if m.low_dtype and rates[c] and rates[c] < rates["fp32"]
    ]
    mode, why = caps.best_mode()
    table.caption = f"recommended: {mode} — {why}"
    if caps.type == "cuda":
        major, minor = caps.cuda_capability
        table.caption += (
            f"; compute capability {major}.{minor}, tensor cores: {'yes' if major >= 7 else 'no'}"
        )
    else:
        flags = [f.upper() for f in CPU_FLAGS if f in caps.cpu_flags] or ["none of note"]
        table.caption += f"; CPU flags: {', '.join(flags)}; {torch.get_num_threads()} threads"
    for m in slower:
        table.caption += f"; warning: {m} matmuls measure slower than fp32 here"
    return table


def main() -> None:
    import os

    cache_dir = Path(os.environ.get("AMP_RUNNER_CACHE", "~/.cache/amp-runner")).expanduser()
    console = Console()
    cuda = torch.version.cuda or "none (CPU build)"
    console.print(
        f"torch {torch.__version__}, CUDA {cuda}, CUDA available: {torch.cuda.is_available()}"
    )
    try:
        for device in devices():
            console.print(report(device, cache_dir))
    except UserError as e:  # AMP_RUNNER_CPU_KIND names no kind
        fail(e)
    console.print(
        "Emulated modes run, but slowly: their speed says nothing about the hardware that has them. "
        "The runner's precision=auto makes the recommended choice."
    )


if __name__ == "__main__":
    main()
