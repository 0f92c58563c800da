"""precision=fp8's format: torchao's float8 training on the Linears that the converting modes'
chooser picks (runner/precision/converted.py, shared with mxfp8, nvfp4 and mxfp4), with fp8's
FLOPs counted on torchao's fp8 tensors (runner/precision/mxfp8.py is precision=mxfp8's format)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from runner.errors import UserError
from runner.precision.converted import ConvertedLinears, import_torchao
from runner.precision.recipe import float8_config

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


class Float8(ConvertedLinears):
    """precision=fp8: torchao's float8 training (`convert_to_float8_training`: `Float8Linear`
    layers with dynamic scales, in one of its recipes)."""

    compute = "fp8"

    def __init__(self, cfg):
        if cfg.recipe not in RECIPES:
            raise UserError(
                f"precision.fp8.recipe={cfg.recipe!r} is invalid: allowed: {', '.join(RECIPES)}"
            )
        super().__init__(cfg)
        self._float8 = None  # torchao.float8, once imported (only where a layer is chosen)
        self._config = None  # the recipe's Float8LinearConfig, once imported

    def _convert(self, model: nn.Module, chosen: dict[str, tuple[str, str, str]]) -> None:
        """One torchao conversion per set of directions: the recipe's cast configs, with both
        operands of each GEMM a rule keeps in bf16 `ScalingType.DISABLED` (torchao then runs
        that GEMM on the high-precision operands)."""
        self._float8 = float8 = import_torchao("torchao.float8", "fp8")
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        if self.all_gather:
            if self.recipe != "tensorwise" or any(f[:2] != ("fp8", "fp8") for f in chosen.values()):
                raise UserError(
                    "precision.fp8.all_gather=true needs precision.fp8.recipe=tensorwise "
                    "(torchao gathers fp8 weights with one scale per tensor) and every converted "
                    "Linear's forward and input_grad in fp8 (precision.recipe)"
                )
            config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        self._config = config
        for formats in set(chosen.values()):
            names = {n for n, f in chosen.items() if f == formats}
            float8.convert_to_float8_training(
                model,
                config=float8_config(float8, config, formats),
                module_filter_fn=lambda _module, fqn, names=names: fqn in names,
            )
            for name in names:  # its input's gradient multiplies the weight in bf16 (_compute)
                model.get_submodule(name)._hp_weight = formats[1] != "fp8"
        self._layer = import_torchao("torchao.float8.float8_linear", "fp8").Float8Linear
        self._gemm_tensor = float8.Float8TrainingTensor

    def _set(self, layer: nn.Module, formats: tuple[str, str, str]) -> None:
        layer.config = float8_config(self._float8, self._config, formats)
        layer._hp_weight = formats[1] != "fp8"

    def _compute(self, layer: nn.Module, low_forward: Callable, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            # as torchao does under CUDA's autocast only: on a CPU the input stayed fp32
            # (rowwise_with_gw_hp's high-precision GEMM then met a bf16 gradient and failed)
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if getattr(layer, "_hp_weight", False) and x.dtype != layer.weight.dtype:
            # a GEMM kept high takes the weight as it is: the bf16 gradient met the fp32
            # weight in the input's gradient (backward runs outside autocast)
            mm = import_torchao("torchao.float8.float8_linear", "fp8").matmul_with_hp_or_float8_args
            y = mm.apply(x, layer.weight.to(x.dtype).t(), layer.linear_mm_config, layer.config)
            return y if layer.bias is None else y + layer.bias.to(y.dtype)
        return low_forward(x)

    def after_step(self) -> None:
        """With fp8 all-gather under FSDP2: the next gather's scales, one collective for all."""
        if self.all_gather and self.active and self._float8:
            self._float8.precompute_float8_dynamic_scale_for_fsdp(self._model)
