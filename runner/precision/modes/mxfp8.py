"""precision=mxfp8: torchao's MXFP8 Linears (block-scaled fp8, one scale per 32 values; chosen
by the same rules as fp8's, converted once, active in mxfp8 stages) and bf16 autocast for the
rest. MXFP8 units come with sm_100 (Blackwell); elsewhere torchao emulates them."""

import torch

from runner.precision.caps import DeviceCaps
from runner.precision.fp8 import Fp8Linears
from runner.precision.modes.fp8 import Fp8
from runner.precision.mxfp8 import MXFP8


class Mxfp8(Fp8):
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

    def linears(self, cfg, caps: DeviceCaps) -> Fp8Linears:
        return MXFP8(cfg, caps)


MODE = Mxfp8("mxfp8", compute="mxfp8", autocast=torch.bfloat16, fp8=True, mfu_also_vs="bf16")
