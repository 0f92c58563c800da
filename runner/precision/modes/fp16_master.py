"""precision=fp16_master: fp16 weights with fp32 master copies that the optimizer steps, fp16
autocast and loss scaling; norm layers and fp32 islands keep fp32 weights."""

from collections.abc import Sequence

import torch
from torch import nn

from runner.precision import adapters
from runner.precision.modes.base import Mode


class Fp16Master(Mode):
    def convert(self, precision, model: nn.Module, islands: Sequence[nn.Module], norms) -> None:
        """Casts the weights to fp16 behind fp32 masters (islands and norms stay fp32, and a
        fine-tune's adapters where precision.adapter_dtype=fp32; its frozen base gets none)."""
        kept = {p for m in islands for p in m.parameters()}
        kept |= {p for m in norms for p in m.parameters(recurse=False)}
        kept |= adapters.kept_fp32(precision.cfg, model)
        precision.master.prepare(model, kept)


MODE = Fp16Master(
    "fp16_master",
    compute="fp16",
    autocast=torch.float16,
    scales_loss=True,
    weights="fp16",
    masters=True,
    stageable=False,
    fsdp_refusal="with trainer.strategy=fsdp use precision=fp16: FSDP's fp32 shards are the master "
    "weights",
)
