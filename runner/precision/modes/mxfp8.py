"""precision=mxfp8: torchao's MXFP8 Linears (block-scaled fp8, one scale per 32 values; chosen
by the converting modes' rules, as fp8's are, converted once, active in mxfp8 stages) and bf16
autocast for the rest. MXFP8 units come with sm_100 (Blackwell); elsewhere torchao emulates them."""

import torch

from runner.precision.caps import DeviceCaps
from runner.precision.modes.base import Converting
from runner.precision.mxfp8 import MXFP8


class Mxfp8(Converting):
    ignored_fp8_keys = (
        (
            "recipe",
            "tensorwise",
            "applies to precision=fp8 only (mxfp8 runs torchao's MXFP8 recipe)",
        ),
        (
            "all_gather",
            False,
            "applies to precision=fp8 only (torchao gathers float8 weights, not MXFP8 ones)",
        ),
    )

    def linears(self, cfg, caps: DeviceCaps) -> MXFP8:
        return MXFP8(cfg, caps)


MODE = Mxfp8("mxfp8", compute="mxfp8", autocast=torch.bfloat16, converts=True, mfu_also_vs="bf16")
