"""fp16_master: fp16 weights, an fp32 master copy of each that the optimizer updates, and fp32
gradients that every micro-batch of a window adds into (a fp16 sum over micro-batches would round
and could overflow at the loss scale)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from runner.errors import UserError

# Gradients averaged over ranks travel in buckets of this size, as DDP's do (its default).
BUCKET_BYTES = 25 * 2**20


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


def average_over_ranks(grads: list[torch.Tensor], world: int, dtype: torch.dtype) -> None:
    """fp16_master's gradients (not DDP-wrapped), averaged over ranks as DDP would: flattened
    into buckets of BUCKET_BYTES sent in `dtype` (bf16 halves the traffic and sums in bf16), one
    all-reduce each, the next one in flight while the last is copied back."""
    pending = None
    for bucket in _buckets(grads, BUCKET_BYTES // dtype.itemsize):
        flat = torch.cat([g.reshape(-1) for g in bucket]).to(dtype)
        work = dist.all_reduce(flat, async_op=True)
        if pending:
            _unflatten(*pending)
        pending = bucket, flat, work
    if pending:
        _unflatten(*pending)
    torch._foreach_div_(grads, world)


def _buckets(grads: list[torch.Tensor], size: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of `grads` of at most `size` elements (a bigger tensor is one alone),
    grouped by dtype and device, which one flat tensor must share."""
    buckets: list[list[torch.Tensor]] = []
    numel = 0
    for grad in grads:
        last = buckets[-1][-1] if buckets else None
        same = last is not None and (last.dtype, last.device) == (grad.dtype, grad.device)
        if not same or numel + grad.numel() > size:
            buckets.append([])
            numel = 0
        buckets[-1].append(grad)
        numel += grad.numel()
    return buckets


def _unflatten(bucket: list[torch.Tensor], flat: torch.Tensor, work) -> None:
    work.wait()
    views = flat.split([g.numel() for g in bucket])
    torch._foreach_copy_(bucket, [v.view_as(g) for v, g in zip(views, bucket, strict=True)])
