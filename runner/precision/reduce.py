"""The dtype gradients are averaged over ranks in (`precision.reduce_dtype`): DDP's comm hook
for bf16, and fp16_master's own averaging of its fp32 gradients (it is not DDP-wrapped)."""

from __future__ import annotations

import torch
import torch.distributed as dist

# Gradients averaged over ranks travel in buckets of this size, as DDP's do (its default).
BUCKET_BYTES = 25 * 2**20


def bf16_average(group, bucket):
    """A DDP comm hook: the bucket's gradients averaged over ranks in bf16 (half the traffic),
    on any backend (PyTorch's own bf16 hook needs NCCL)."""
    group = group or dist.group.WORLD
    low = bucket.buffer().div(dist.get_world_size(group)).bfloat16()
    future = dist.all_reduce(low, group=group, async_op=True).get_future()

    def back(done):
        return bucket.buffer().copy_(done.value()[0])

    return future.then(back)


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
