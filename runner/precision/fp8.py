"""precision=fp8: torchao's float8 training on the model's `nn.Linear` layers, bf16 autocast for
everything else. Which Linears are converted, and why the others are not, is decided here and
reported; in a `staged` run the converted layers compute in fp8 only in fp8 stages."""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from runner.errors import UserError

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
FIRST, LAST = "first", "last"  # in `skip`: the model's first and last Linear layers
FP8_DIMENSION = 16  # the fp8 GEMM kernels need both dimensions to be multiples of this


def _torchao_float8():
    """torchao's float8 module, imported only when fp8 is asked for (it is a large import)."""
    from runner.optim import quiet_torchao  # here: runner.optim imports runner.precision

    quiet_torchao()
    try:
        import torchao.float8 as float8
    except ImportError:
        raise UserError(
            "precision=fp8 needs torchao (pip install torchao, the release that fits your torch: "
            "0.18.0 for torch 2.13)"
        ) from None
    return float8


def _conv1d_to_linear(model: nn.Module) -> None:
    """transformers' `Conv1D` (GPT-2's projections) replaced by the `nn.Linear` it computes."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ == "Conv1D" and child.weight.ndim == 2:
                n_in, n_out = child.weight.shape
                linear = nn.Linear(n_in, n_out, device=child.weight.device)
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    linear.bias.copy_(child.bias)
                setattr(parent, name, linear)


class Float8:
    """Converts the chosen Linears once (before compile and DDP/FSDP wrapping) and switches them
    between fp8 and their plain forward as the run's stages go in and out of fp8."""

    def __init__(self, cfg):
        if cfg.recipe not in RECIPES:
            raise UserError(
                f"precision.fp8.recipe={cfg.recipe!r} is invalid: allowed: {', '.join(RECIPES)}"
            )
        self.recipe, self.patterns = cfg.recipe, list(cfg.skip)
        self.min_features, self.all_gather = cfg.min_features, cfg.all_gather
        self.converted: list[str] = []
        self.skipped: dict[str, str] = {}
        self.active = False
        self._modules: list[nn.Module] = []

    def _skip_reason(self, name: str, linear: nn.Linear, order: list[str]) -> str | None:
        dims = (linear.in_features, linear.out_features)
        if any(d % FP8_DIMENSION for d in dims):
            return f"dimensions {dims[0]}×{dims[1]} are not multiples of {FP8_DIMENSION}"
        if min(dims) < self.min_features:
            return f"smaller than precision.fp8.min_features={self.min_features}"
        for pattern in self.patterns:
            if (pattern == FIRST and name == order[0]) or (pattern == LAST and name == order[-1]):
                return f"the {pattern} Linear layer (precision.fp8.skip)"
            if pattern not in (FIRST, LAST) and fnmatch.fnmatchcase(name, pattern):
                return f"matches {pattern!r} (precision.fp8.skip)"
        return None

    def prepare(self, model: nn.Module, islands: Iterable[nn.Module]) -> None:
        """Converts every Linear not skipped; Linears inside fp32 islands stay high precision.
        GPT-2's `Conv1D` layers (Linears with the weight stored transposed) become Linears first,
        so they convert too."""
        _conv1d_to_linear(model)
        in_islands = {id(m) for island in islands for m in island.modules()}
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        order = [n for n, _ in linears]
        chosen = set()
        for name, linear in linears:
            reason = "inside an fp32 island" if id(linear) in in_islands else None
            if type(linear) is not nn.Linear:
                reason = reason or f"a {type(linear).__name__}, not a plain nn.Linear"
            reason = reason or self._skip_reason(name, linear, order)
            if reason:
                self.skipped[name] = reason
            else:
                chosen.add(name)
        self._model = model
        if not chosen:
            return
        float8 = _torchao_float8()
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        if self.all_gather:
            if self.recipe != "tensorwise":
                raise UserError(
                    "precision.fp8.all_gather=true needs precision.fp8.recipe=tensorwise "
                    "(torchao gathers fp8 weights with one scale per tensor)"
                )
            config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        float8.convert_to_float8_training(
            model, config=config, module_filter_fn=lambda _module, fqn: fqn in chosen
        )
        for name, module in model.named_modules():
            if name in chosen:
                self._switchable(module)
                self.converted.append(name)

    def _switchable(self, module: nn.Module) -> None:
        """Outside fp8 stages the layer runs as the plain Linear it was (same weights). Under
        `inference_mode` (evaluation) torchao's fp8 tensors fail, so it runs under `no_grad`."""
        fp8_forward = module.forward

        @functools.wraps(fp8_forward)
        def forward(x: torch.Tensor) -> torch.Tensor:
            if not self.active:
                return nn.Linear.forward(module, x)
            if torch.is_inference_mode_enabled():  # evaluation: torchao's fp8 needs plain no_grad
                with torch.inference_mode(False), torch.no_grad():
                    return fp8_forward(x)
            return fp8_forward(x)

        module.forward = forward
        self._modules.append(module)

    def after_step(self) -> None:
        """With fp8 all-gather under FSDP2: the next gather's scales, one collective for all."""
        if self.all_gather and self.active and self.converted:
            _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(self._model)

    def report(self) -> dict:
        return {"recipe": self.recipe, "converted": self.converted, "skipped": self.skipped}

    @contextlib.contextmanager
    def counting(self) -> Iterator[dict]:
        """The fp8 GEMM FLOPs of the steps run inside (the audited one): per converted layer's
        call, its forward GEMM and, in backward, the weight's gradient and (where the input
        needs one) the input's. Counted by layer, since on a CPU torchao emulates the fp8 GEMMs
        in bf16 and the ops alone do not show them."""
        counts = {"fp8_flops_per_step": 0}

        def count(module: nn.Module, inputs: tuple, _output) -> None:
            x = inputs[0]
            rows = x.numel() // module.in_features
            gemms = 1 + module.weight.requires_grad + x.requires_grad
            counts["fp8_flops_per_step"] += (
                2 * rows * module.in_features * module.out_features * gemms
            )

        hooks = [m.register_forward_hook(count) for m in self._modules] if self.active else []
        try:
            yield counts
        finally:
            for hook in hooks:
                hook.remove()
