"""fp16_master: fp16 weights, an fp32 master copy of each that the optimizer updates, and fp32
gradients that every micro-batch of a window adds into (a fp16 sum over micro-batches would round
and could overflow at the loss scale)."""

from __future__ import annotations

import torch

from runner.errors import UserError


class MasterWeights:
    def __init__(self):
        self.masters: dict[torch.nn.Parameter, torch.nn.Parameter] = {}  # model param → fp32

    def __bool__(self) -> bool:
        return bool(self.masters)

    def prepare(self, model: torch.nn.Module, keep: set[torch.nn.Parameter]) -> None:
        """Cast the model's weights to fp16, except `keep` (norm layers' and fp32 islands'). Each
        trainable one gets an fp32 copy, taken before the cast; frozen ones need none."""
        for param in model.parameters():
            if param.dtype != torch.float32 or param in keep or param in self.masters:
                continue
            if param.requires_grad:
                self.masters[param] = torch.nn.Parameter(param.detach().clone())
            param.data = param.data.half()

    def stand_ins(self, params) -> list:
        """The parameters the optimizers update: the fp32 masters where there are any."""
        return [self.masters.get(p, p) for p in params]

    def optimizer_groups(self, groups: dict[str, list]) -> dict[str, list]:
        return {name: self.stand_ins(params) for name, params in groups.items()}

    def accumulate(self) -> None:
        """After each micro-batch's backward: its fp16 gradients are added into the fp32 ones
        (one foreach add for all of them; the window's first micro-batch makes them)."""
        into, grads = [], []
        for param, master in self.masters.items():
            if param.grad is None:
                continue
            if master.grad is None:
                master.grad = param.grad.float()
            else:
                into.append(master.grad)
                grads.append(param.grad)
            param.grad = None
        if into:
            torch._foreach_add_(into, grads)

    @torch.no_grad()
    def copy_back(self) -> None:
        """After the step: the fp16 weights are the masters rounded (a skipped step left the
        masters as they were, so copying is harmless)."""
        if self.masters:
            torch._foreach_copy_(list(self.masters), list(self.masters.values()))

    def memory(self, model: torch.nn.Module) -> dict:
        def mb(params) -> float:
            return sum(p.numel() * p.element_size() for p in params) / 2**20

        return {
            "weights_mb": mb(model.parameters()),
            "master_weights_mb": mb(self.masters.values()),
        }

    def state_dict(self) -> dict:
        return {"master_weights": list(self.masters.values())} if self.masters else {}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        saved = state.get("master_weights") or []
        if self.masters and len(saved) != len(self.masters):
            raise UserError("the checkpoint has no fp32 master weights for precision=fp16_master")
        for (param, master), value in zip(self.masters.items(), saved, strict=False):
            master.copy_(value)
            param.copy_(value)
