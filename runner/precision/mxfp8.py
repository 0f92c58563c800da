"""precision=mxfp8's format: torchao's MXFP8 training (fp8 e4m3 values with one power-of-two
scale per block of 32 along each GEMM's inner dimension), on the Linears that precision.fp8's
skip rules choose (runner/precision/converted.py, shared with fp8, nvfp4 and mxfp4).

torchao 0.18 trains dense Linears in MXFP8 with `MXFP8Linear` (moe_training/mxfp8_linear.py):
an `nn.Linear` whose three GEMMs quantize their operands to MXFP8 and run torchao's sm_100
kernels, or their emulation in PyTorch (`KernelPreference.EMULATED`: any device). Its recipes
are `MXFP8TrainingOpConfig`'s. That config's own conversion (`quantize_`, weights wrapped in
`MXFP8TrainingWeightWrapperTensor`) is not used: it drops an `nn.Linear`'s bias."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from runner.precision.caps import DeviceCaps
from runner.precision.converted import ConvertedLinears, import_torchao


class MXFP8(ConvertedLinears):
    """Chosen Linears become torchao's `MXFP8Linear` (same weights): its kernels where the GPU
    has MXFP8 units (sm_100+), its emulation elsewhere (a CPU; a GPU with allow_emulated)."""

    alignment = 32  # MXFP8's block: every GEMM's inner dimension is scaled in blocks of 32
    compute = "mxfp8"

    def __init__(self, cfg, caps: DeviceCaps):
        super().__init__(cfg)
        self.native = caps.type == "cuda" and caps.support("mxfp8")[0]
        # torchao's recipe names: the kernels, or the same numerics emulated
        self.recipe = "mxfp8_rceil" if self.native else "mxfp8_emulated_rceil"
        self._out_dtype: torch.dtype | None = None  # the recipe's, set at conversion

    def _convert(self, model: nn.Module, chosen: dict[str, tuple[str, str, str]]) -> None:
        """Each chosen Linear an `MXFP8Linear`: its forward and input gradient in MXFP8 (torchao
        switches neither alone), its weight's gradient in high precision where its rule keeps
        that direction bf16 (`wgrad_with_hp`)."""
        config = import_torchao("torchao.prototype.moe_training.config", "mxfp8")
        linear = import_torchao("torchao.prototype.moe_training.mxfp8_linear", "mxfp8")
        recipe = config.MXFP8TrainingOpConfig.from_recipe(config.MXFP8TrainingRecipe(self.recipe))
        self._out_dtype = recipe.out_dtype
        for name, formats in chosen.items():
            parent, _, child = name.rpartition(".")
            old = model.get_submodule(name)
            new = linear.MXFP8Linear(
                old.in_features,
                old.out_features,
                bias=old.bias is not None,
                device="meta",  # no weights of its own: it takes the Linear's
                kernel_preference=recipe.kernel_preference,
                scale_calculation_mode=recipe.scale_calculation_mode,
                wgrad_with_hp=recipe.wgrad_with_hp or formats[2] != "mxfp8",
            )
            new.weight, new.bias = old.weight, old.bias
            new.train(old.training)
            setattr(model.get_submodule(parent) if parent else model, child, new)
        self._layer = linear.MXFP8Linear
        self._gemm_tensor = import_torchao(
            "torchao.prototype.mx_formats.mx_tensor", "mxfp8"
        ).MXTensor

    def _set(self, layer: nn.Module, formats: tuple[str, str, str]) -> None:
        layer.wgrad_with_hp = formats[2] != "mxfp8"

    def _compute(self, layer: nn.Module, low_forward: Callable, x: torch.Tensor) -> torch.Tensor:
        # The sm_100 kernels take any high-precision operands and return the recipe's out_dtype
        # (bf16). The emulation multiplies the dequantized operands in their own dtype, so they
        # must match (a bf16 input, the fp32 weight: the input widened, which changes no MXFP8
        # value), and its result is rounded to bf16 as the GPU's is.
        x = x.to(layer.weight.dtype)
        return (low_forward(x) if self.native else _eagerly(low_forward, x)).to(self._out_dtype)


@torch.compiler.disable
def _eagerly(low_forward: Callable, x: torch.Tensor) -> torch.Tensor:
    """The emulation outside torch.compile: Inductor's CPU code for it, with a dynamic row count
    padded to one block of 32, computes a wrong weight gradient (torch 2.13; garbage up to 1e36,
    tests/test_mxfp8.py). The emulation is there for its numerics, not its speed."""
    return low_forward(x)
