"""Optimizer and learning-rate schedule from the `optim` config group."""

from __future__ import annotations

import importlib.util
import math

import torch
from hydra.utils import instantiate
from torch import nn

from runner import console
from runner.config.schema import ADAMW
from runner.errors import UserError, building
from runner.precision import bf16_true

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update, computed in fp32 one weight at a time, for what torch's cannot
    do: moments held in `state_dtype` whatever the weights are (bf16: half of fp32's state; None:
    the weight's dtype), and bf16_true's update rules (`runner.precision.bf16_true`: stochastic
    rounding, or a Kahan compensation buffer kept in the state). Eager and unfused: built only for
    `optim.state_dtype` or a bf16_true update other than plain."""

    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, state_dtype=None
    ):
        self.state_dtype = state_dtype
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            (beta1, beta2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    dtype = self.state_dtype or p.dtype
                    state["step"] = torch.tensor(0.0)  # on the CPU, as torch's: no device sync
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
                    bf16_true.start(p, state)
                state["step"] += 1
                step = state["step"].item()
                grad = p.grad.float()
                exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"].copy_(exp_avg)  # a no-op where the state is fp32
                state["exp_avg_sq"].copy_(exp_avg_sq)
                weight = bf16_true.weight(p, state)
                weight.mul_(1 - lr * group["weight_decay"])
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
                weight.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
                bf16_true.write(p, weight, state)

    def load_state_dict(self, state_dict: dict) -> None:
        """The state in the dtypes it was saved in: torch casts it to each weight's dtype, which
        would widen bf16 moments of fp32 weights and round fp32 moments of bf16 ones."""
        super().load_state_dict(state_dict)
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(ids, params, strict=True):
            for key, value in state_dict["state"].get(i, {}).items():
                if key != "step":
                    self.state[p][key] = value.to(p.device)


def _torchao_optimizer(node, groups: list[dict], stochastic_rounding: bool):
    """A torchao optimizer (optim=adamw8bit), torchao imported only now. Its quantized state
    tensors are saved as their plain parts, so a checkpoint loads with weights_only=True before
    torchao is imported (a resume reads it before the optimizer is built)."""
    console.quiet_torchao()
    if importlib.util.find_spec("torchao") is None:
        raise UserError(
            f"optim.optimizer._target_={node._target_} needs torchao: scripts/setup.sh installs "
            "the release that matches torch (torchao==0.18.0 for torch 2.13)"
        )
    extra = {"bf16_stochastic_round": True} if stochastic_rounding else {}
    optimizer = instantiate(node, _convert_="all", **extra)(groups)  # betas: a list, not ListConfig
    _float_lr(optimizer)
    optimizer.register_step_pre_hook(_tensor_lr)
    optimizer.register_step_post_hook(_float_lr)
    optimizer.register_state_dict_post_hook(_plain_state)
    optimizer.register_load_state_dict_pre_hook(_quantized_state)
    return optimizer


def _tensor_lr(optimizer, *_) -> None:
    """torchao's step takes the learning rate as a tensor (a new rate is then no recompile); the
    schedule, the logs and the checkpoint take a number: a tensor only during the step."""
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(group["lr"])


def _float_lr(optimizer, *_) -> None:
    for group in optimizer.param_groups:
        group["lr"] = float(group["lr"])


def _plain_state(_optimizer, state_dict: dict) -> dict:
    """Each quantized state tensor as {subclass, tensors, attributes} (new dicts: the state
    dict's per-weight dicts are the optimizer's own)."""

    def plain(value):
        if not hasattr(type(value), "__tensor_unflatten__"):
            return value
        names, attributes = value.__tensor_flatten__()
        tensors = {name: getattr(value, name) for name in names}
        return {"subclass": type(value).__name__, "tensors": tensors, "attributes": attributes}

    state = {i: {k: plain(v) for k, v in s.items()} for i, s in state_dict["state"].items()}
    return {**state_dict, "state": state}


def _quantized_state(_optimizer, state_dict: dict) -> dict:
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8

    classes = {c.__name__: c for c in (OptimState4bit, OptimState8bit, OptimStateFp8)}

    def quantized(value):
        if not (isinstance(value, dict) and "subclass" in value):
            return value
        cls = classes[value["subclass"]]
        return cls.__tensor_unflatten__(value["tensors"], value["attributes"], None, None)

    state = {i: {k: quantized(v) for k, v in s.items()} for i, s in state_dict["state"].items()}
    return {**state_dict, "state": state}


def build_optimizer(cfg, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Weight decay on weight matrices only: biases and norm scales are left alone. The runner's
    AdamW stands in for torch's where the moments' dtype differs from a weight's
    (`optim.state_dtype`) or a bf16 weight needs an update rule (`precision.update`); both are
    checked against the optimizer by `runner.config.validation.validate`."""
    groups = [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    node = cfg.optimizer
    state_dtype = STATE_DTYPES.get(cfg.get("state_dtype"))
    rules = {getattr(p, "bf16_update", "plain") for p in params}
    with building("optim.optimizer", node):  # `_partial_`: the call raises, too
        if str(node.get("_target_")).startswith("torchao."):
            return _torchao_optimizer(node, groups, "stochastic_rounding" in rules)
        if node.get("_target_") == ADAMW and (
            rules - {"plain"} or any(p.dtype != state_dtype for p in params if state_dtype)
        ):
            keys = ("lr", "betas", "eps", "weight_decay")
            return AdamW(groups, state_dtype=state_dtype, **{k: node[k] for k in keys if k in node})
        return instantiate(node)(groups)


def lr_factor(
    step: int, max_steps: int, warmup_steps: int, decay: str, min_lr_ratio: float
) -> float:
    """Linear warm-up to the peak, then `decay` down to `min_lr_ratio` of it at `max_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if decay == "constant":
        return 1.0
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1 - progress
    return min_lr_ratio + (1 - min_lr_ratio) * shape


def build_scheduler(cfg, optimizer: torch.optim.Optimizer, max_steps: int):
    """Advanced only on optimizer steps that were applied (not on steps the scaler skipped).
    The keys are checked by `runner.config.validation.validate`."""
    s = cfg.scheduler
    shape = (s.warmup_steps, s.decay, s.min_lr_ratio)  # plain values: the lambda runs every step
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, max_steps, *shape)
    )


def build_optimizers(
    cfg, groups: dict[str, list[nn.Parameter]], max_steps: int
) -> tuple[dict, dict]:
    """One optimizer and one schedule per parameter group (a GAN has two: see
    `Task.parameter_groups`, and `Precision.optimizer_groups` for fp16_master's fp32 copies)."""
    optimizers = {name: build_optimizer(cfg, params) for name, params in groups.items()}
    schedulers = {name: build_scheduler(cfg, opt, max_steps) for name, opt in optimizers.items()}
    return optimizers, schedulers
