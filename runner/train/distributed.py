"""Several processes, one run (`torchrun --nproc_per_node=N -m runner ...`): the process group,
the device of each rank, and the few collectives the loop needs. Rank 0 alone writes metrics,
checkpoints and the W&B run; every rank takes the same decisions from the same reduced values.

With one process (no torchrun) everything here is a no-op, so the single-device path stays the
plain loop."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runner.errors import UserError
from runner.precision.fp32_islands import is_island
from runner.precision.norms import norm_layers
from runner.precision.reduce import bf16_average


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def from_env() -> Dist:
    """torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), or one process."""
    try:
        return Dist(
            int(os.environ.get("RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)),
        )
    except ValueError:
        raise UserError(
            "RANK, WORLD_SIZE and LOCAL_RANK must be integers (start several processes with torchrun)"
        ) from None


def _adopt_submitit_tasks() -> None:
    """A Hydra submitit job (SLURM, or local) with several tasks: each task is a rank. submitit
    knows the tasks and hosts; export them as torchrun would have."""
    if "RANK" in os.environ or "SUBMITIT_EXECUTOR" not in os.environ:
        return
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    if JobEnvironment().num_tasks > 1:
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def init() -> Dist:
    """Joins the process group torchrun (or a submitit job's tasks) describes: gloo for CPU
    tensors, NCCL for CUDA ones."""
    _adopt_submitit_tasks()
    d = from_env()
    if d.enabled and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(d.local_rank % torch.cuda.device_count())
            dist.init_process_group("cpu:gloo,cuda:nccl")
        else:
            dist.init_process_group("gloo")
    return d


def launch_overrides(d: Dist, args: list[str]) -> list[str]:
    """Hydra names the run directory after the clock, and ranks start a moment apart: all of them
    take rank 0's time, and only rank 0 writes Hydra's files there."""
    if not d.enabled:
        return []
    stamp = [time.strftime("%Y-%m-%d/%H-%M-%S")]
    dist.broadcast_object_list(stamp, src=0, device=torch.device("cpu"))
    given = {a.split("=")[0] for a in args}
    overrides = [
        f"{key}={base}/{stamp[0]}"
        for key, base in (("hydra.run.dir", "outputs"), ("hydra.sweep.dir", "multirun"))
        if key not in given
    ]
    if not d.main:
        overrides += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    return overrides


def device_for(d: Dist, device: torch.device) -> torch.device:
    """Each rank drives its own GPU (LOCAL_RANK); CPU ranks share the CPU."""
    if d.enabled and device.type == "cuda":
        return torch.device("cuda", d.local_rank)
    return device


REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def wrap(task: torch.nn.Module, d: Dist, strategy: str, precision, device: torch.device):
    """The module the forward and backward go through. DDP: a wrapper that averages gradients
    (fp16_master averages its fp32 gradients itself, so it is left unwrapped). FSDP2
    (`fully_shard`, in place, before the optimizer is built): see `_shard`."""
    if not d.enabled:
        if strategy == "fsdp":
            raise UserError(
                "trainer.strategy=fsdp shards over several processes: start them with "
                "torchrun --nproc_per_node=N -m runner ..."
            )
        return task
    reduce_dtype = REDUCE_DTYPES[precision.cfg.reduce_dtype]
    if strategy == "fsdp":
        low = precision.dtype if precision.requested != "staged" else None
        _shard(task, low, reduce_dtype, norm_layers(task, precision.cfg.norm_modules))
        return task
    if precision.master:
        return task
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(task, device_ids=[device] if device.type == "cuda" else None)
    if reduce_dtype == torch.bfloat16:
        ddp.register_comm_hook(None, bf16_average)
    return ddp


# Under autocast these and norm layers keep fp32 weights (autocast only casts matmul-like ops),
# so FSDP gathers them in fp32 too: the same numerics as DDP for the same precision mode.
FP32_UNDER_AUTOCAST = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def _shard(
    task: torch.nn.Module,
    low: torch.dtype | None,
    reduce_dtype: torch.dtype,
    norms: set[torch.nn.Module],
) -> None:
    """FSDP2 with the numerics of DDP under autocast. The task's shard units (its big blocks)
    gather their parameters in the mode's low precision (`low`, fixed at wrap time: a staged run
    gathers fp32 and autocasts), as autocast would cast them for their matmuls; inside them,
    norm layers, embeddings and fp32 islands are sharded apart first, in fp32 (and so is a
    unit that is itself one). The root unit
    (embeddings, heads, tied weights, islands outside the blocks) gathers fp32 and lets autocast
    cast per op. A shard unit inside an island belongs to the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # Inputs are left as they come: autocast casts per op, and a residual stream stays fp32.
    fp32, low_policy = (
        MixedPrecisionPolicy(dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
        for dtype in (torch.float32, low)
    )
    in_islands = {id(m) for i in task.modules() if is_island(i) for m in list(i.modules())[1:]}
    units = [u for u in task.shard_units() if id(u) not in in_islands]
    covered = {id(m) for u in units for m in u.modules()}
    apart = set()
    if low is not None:
        for module in reversed(list(task.modules())):  # children before their parents
            if (
                id(module) in covered
                and id(module) not in in_islands
                and (
                    is_island(module) or module in norms or isinstance(module, FP32_UNDER_AUTOCAST)
                )
            ):
                fully_shard(module, mp_policy=fp32)
                apart.add(id(module))
    for unit in units:
        if id(unit) not in apart:
            fully_shard(unit, mp_policy=low_policy)
    fully_shard(task, mp_policy=fp32)


@contextlib.contextmanager
def no_grad_sync(model: torch.nn.Module):
    """Accumulate gradients locally: the micro-batches of a window before its last."""
    if hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


@contextlib.contextmanager
def gathered(task: torch.nn.Module, sharded: bool):
    """FSDP: the root unit's whole weights, for calls that bypass its forward (evaluation
    calls the task's own methods). Every rank takes part. The shard units gather themselves."""
    if not sharded:
        yield
        return
    task.unshard()
    try:
        yield
    finally:
        task.reshard()


@contextlib.contextmanager
def main_first(d: Dist):
    """Rank 0 runs the block first (it writes the caches: corpus, tokenizer, tokenized data),
    then the others, which read what it wrote instead of racing to write it too."""
    if not d.main:
        barrier(d)
    try:
        yield
    finally:  # also when rank 0 fails: the others then fail on their own, with the same error
        if d.main:
            barrier(d)


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def sum_(tensor: torch.Tensor, d: Dist) -> torch.Tensor:
    """The sum over ranks, in place (asynchronous on a GPU: no host wait)."""
    if d.enabled:
        dist.all_reduce(tensor)
    return tensor


def sum_values(values: dict[str, torch.Tensor], d: Dist) -> dict[str, torch.Tensor]:
    """Scalars on the device, each summed over ranks, in one all-reduce."""
    if not d.enabled:
        return values
    summed = sum_(torch.stack(list(values.values())), d)
    return dict(zip(values, summed.unbind(), strict=True))


def count_over_ranks(
    count: int, flag: bool, d: Dist, device: torch.device
) -> tuple[torch.Tensor | int, torch.Tensor]:
    """A host-side count summed over ranks (at least 1), and how many ranks raised `flag`, in one
    all-reduce on the device, so nobody waits (the flag's reader decides when to)."""
    if not d.enabled:
        return max(1, count), torch.tensor(float(flag))
    shared = torch.tensor([float(count), float(flag)])
    if device.type == "cuda":  # a copy from pinned memory does not wait for the GPU
        shared = shared.pin_memory()
    summed = sum_(shared.to(device, non_blocking=True), d)
    return summed[0].clamp(min=1), summed[1]


def gather(obj, d: Dist) -> list:
    """Every rank's `obj`, in rank order (on every rank)."""
    if not d.enabled:
        return [obj]
    out: list = [None] * d.world
    dist.all_gather_object(out, obj)
    return out


def close(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.destroy_process_group()
