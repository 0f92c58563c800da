"""precision=bf16_true: bf16 weights, gradients and optimizer state, no autocast, no masters
(runner/precision/bf16_true.py); fp32 islands, and norm layers unless told, keep fp32."""

from collections.abc import Sequence

from torch import nn

from runner.precision import adapters, bf16_true
from runner.precision.modes.base import Mode


class Bf16True(Mode):
    def keeps_norms_fp32(self, cfg) -> bool:
        return cfg.keep_norms_fp32

    def convert(self, precision, model: nn.Module, islands: Sequence[nn.Module], norms) -> None:
        """Casts the weights to bf16 with their update rule and the casts at module boundaries;
        a fine-tune's adapters as precision.adapter_dtype says. An island's weights stay fp32
        also where another module shares them (a head tied to the input embedding)."""
        cfg = precision.cfg
        kept = norms if self.keeps_norms_fp32(cfg) else set()
        keep = adapters.kept_fp32(cfg, model) | {p for m in islands for p in m.parameters()}
        bf16_true.prepare(model, islands, kept, cfg["update"], keep)


MODE = Bf16True(
    "bf16_true",
    compute="bf16",
    weights="bf16",
    stageable=False,
    fsdp_refusal="with trainer.strategy=fsdp use precision=bf16: FSDP2 gathers one dtype per unit "
    "(not bf16 weights beside fp32 norms), and its fp32 shards already split the weight memory",
)
