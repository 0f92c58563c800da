"""precision=nvfp4: NVIDIA's FP4 training recipe (arXiv 2509.25149), emulated: the Linears the
converting modes' chooser picks (read from precision.fp4) compute their three GEMMs in NVFP4 (E2M1
in blocks of 16, an E4M3 scale per block, an FP32 scale per tensor) with 16×16 weight tiles, a
random Hadamard transform of the weight gradient's inputs and stochastically rounded gradients,
each a switch (runner/precision/fp4.py); bf16 autocast for the rest."""

from collections.abc import Sequence

import torch
from torch import nn

from runner.precision.caps import DeviceCaps
from runner.precision.fp4 import Fp4Linears
from runner.precision.fp4_quant import FORMATS
from runner.precision.modes.base import Converting

# precision.fp8's keys, refused unless unset: fp4's chooser reads precision.fp4
_FP8_KEYS = (
    ("recipe", "tensorwise"),
    ("skip", ["first", "last"]),
    ("min_features", 0),
    ("all_gather", False),
    ("keep_bf16", {"first": 0, "last": 0}),
    ("convert_adapters", False),
)


class Fp4(Converting):
    """An FP4 format (its `compute`: nvfp4 or mxfp4), the converting modes' chooser on
    precision.fp4's keys."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        name = self.name
        ignored = tuple(
            (key, unset, f"applies to fp8 and mxfp8; precision={name} reads precision.fp4.{key}")
            if key in ("skip", "min_features", "keep_bf16", "convert_adapters")
            else (key, unset, f"applies to precision=fp8 only (precision={name} is emulated)")
            for key, unset in _FP8_KEYS
        )
        object.__setattr__(self, "ignored_fp8_keys", ignored)

    def linears(self, cfg, caps: DeviceCaps) -> Fp4Linears:
        return Fp4Linears(cfg, FORMATS[self.compute])

    def convert(self, precision, model: nn.Module, islands: Sequence[nn.Module], norms) -> None:
        precision.converted.configure(precision.cfg.fp4)
        super().convert(precision, model, islands, norms)


MODE = Fp4("nvfp4", compute="nvfp4", autocast=torch.bfloat16, converts=True, mfu_also_vs="bf16")
