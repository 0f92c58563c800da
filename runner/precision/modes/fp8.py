"""precision=fp8: torchao's fp8 Linears (converted once, active in fp8 stages) and bf16 autocast
for the rest."""

import torch

from runner.precision.caps import DeviceCaps
from runner.precision.fp8 import Float8
from runner.precision.modes.base import Converting


class Fp8(Converting):
    def linears(self, cfg, caps: DeviceCaps) -> Float8:
        return Float8(cfg)


MODE = Fp8("fp8", compute="fp8", autocast=torch.bfloat16, converts=True, mfu_also_vs="bf16")
