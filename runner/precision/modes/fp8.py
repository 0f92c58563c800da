"""precision=fp8: torchao's fp8 Linears (converted once, active in fp8 stages) and bf16 autocast
for the rest."""

from collections.abc import Sequence

import torch
from torch import nn

from runner.precision.caps import DeviceCaps
from runner.precision.fp8 import Float8, Fp8Linears
from runner.precision.modes.base import Mode


class Fp8(Mode):
    # precision.fp8 keys this format ignores, each refused at validation unless unset:
    # (key, its unset value, why)
    ignored_fp8_keys: tuple[tuple[str, object, str], ...] = ()

    def linears(self, cfg, caps: DeviceCaps) -> Fp8Linears:
        """What converts and switches its Linears (`cfg`: precision.fp8)."""
        return Float8(cfg)

    def convert(self, precision, model: nn.Module, islands: Sequence[nn.Module], norms) -> None:
        """Converts the Linears to fp8 (islands left out)."""
        precision.fp8.prepare(model, islands)


MODE = Fp8("fp8", compute="fp8", autocast=torch.bfloat16, fp8=True, mfu_also_vs="bf16")
