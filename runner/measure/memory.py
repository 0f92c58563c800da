"""Memory by category and dtype, counted exactly and per job (never the process's peak, which a
sweep's later jobs inherit): the parameters that train, the frozen ones (a LoRA fine-tune's base,
model.freeze), gradients, optimizer state, fp32 master copies, and the activations saved for
backward in one step, which is what autocast saves. Beside them, the peaks the device or the
process reports (peak_memory_mb), which is what a user's monitor shows."""

from __future__ import annotations

import contextlib
import resource
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runner.train.trainer import Trainer

MB = 2**20


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak allocated by tensors. CPU: the process's peak resident set (it cannot be reset,
    so in a multirun it is the peak so far)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / MB if sys.platform == "darwin" else rss / 2**10


def peak_reserved_mb(device: torch.device) -> float | None:
    """CUDA: the caching allocator's peak reservation, what the run held of the GPU (allocated
    plus cached blocks); None elsewhere."""
    return torch.cuda.max_memory_reserved(device) / MB if device.type == "cuda" else None


def local(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter's own shard: what this rank holds."""
    return t.to_local() if hasattr(t, "to_local") else t


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _storage(t: torch.Tensor) -> int:
    """The identity of a tensor's storage, shared by its views. Not its address: FSDP frees a
    gathered weight's memory after the forward while autograd keeps the storage, and the address
    is then reused by the next unit's tensors."""
    return t.untyped_storage()._cdata


def _parts(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors a tensor holds: a subclass (torchao's 8-bit optimizer state: uint8 codes,
    fp32 scales) by its parts, not by the dtype it shows."""
    t = local(t)
    if hasattr(t, "__tensor_flatten__"):
        for name in t.__tensor_flatten__()[0]:
            yield from _parts(getattr(t, name))
    else:
        yield t


def _bytes_by_dtype(tensors: Iterable[torch.Tensor]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for t in (part for tensor in tensors for part in _parts(tensor)):
        out[_dtype(t)] += t.numel() * t.element_size()
    return dict(out)


class SavedActivations:
    """Counts what autograd saves for backward during forwards (`counting()`), each storage once
    per forward, the parameters themselves left out (they are counted as parameters; autocast's
    low-precision copies of them are counted here: they are what autocast adds). Every parameter,
    frozen ones too, is read off `model` as it stands when a tensor is saved: under FSDP a unit
    holds its gathered full weights then, not its shard. The figure is the largest forward's:
    with accumulation, a micro-batch's saved tensors are freed by its backward before the next
    forward."""

    def __init__(self, model: torch.nn.Module | None = None):
        self._model = model
        self._held = {n: p.dtype for n, p in model.named_parameters()} if model else {}
        self.by_dtype: dict[str, int] = {}

    def _weights(self) -> set[int]:
        """The storages of the parameters in their own dtype. FSDP gathering a unit in a lower
        dtype makes the copy autocast makes under DDP, and is counted as DDP counts that."""
        named = self._model.named_parameters() if self._model else ()
        return {_storage(local(p)) for n, p in named if p.dtype == self._held[n]}

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        seen: set[int] = set()
        forward: dict[str, int] = defaultdict(int)

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = _storage(t)
            if key not in seen and key not in self._weights():
                seen.add(key)
                forward[_dtype(t)] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        if sum(forward.values()) > sum(self.by_dtype.values()):
            self.by_dtype = dict(forward)


def _category(by_dtype: dict[str, int]) -> dict:
    return {
        "mb": sum(by_dtype.values()) / MB,
        "by_dtype": {k: v / MB for k, v in sorted(by_dtype.items())},
    }


def account(
    model: torch.nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    masters: Iterable[torch.Tensor],
    activations: dict[str, int] | None,
    device: torch.device,
) -> dict:
    """`summary.json`'s `memory`: each category's MB and its split by dtype, their `total`, and on
    CUDA the measured `peak` (allocated) and `reserved`, and what the categories leave
    `unaccounted` (workspaces, temporaries, fragmentation). `params` are the weights that train,
    `frozen` those that do not. A gradient has its parameter's dtype and exists for every
    trainable parameter (fp16_master: its fp32 masters have one too)."""
    masters = list(masters)
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = [
        v
        for opt in optimizers
        for s in opt.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    ]
    categories = {
        "params": _bytes_by_dtype(trainable),
        "frozen": _bytes_by_dtype(p for p in model.parameters() if not p.requires_grad),
        "grads": _bytes_by_dtype(trainable + masters),
        "optimizer": _bytes_by_dtype(state),
        "masters": _bytes_by_dtype(masters),
        "activations": activations or {},
    }
    memory = {name: _category(by_dtype) for name, by_dtype in categories.items()}
    total = sum(c["mb"] for c in memory.values())
    memory["total"] = total
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / MB
        memory |= {
            "peak": peak,
            "reserved": torch.cuda.max_memory_reserved(device) / MB,
            "unaccounted": peak - total,
        }
    else:
        memory["peak"] = None  # a CPU process's peak is not one job's: the accounted total is
    return memory


def trainer_memory(trainer: Trainer) -> dict:
    """`account` of what a trainer holds once it has fitted: its task, its optimizers' state, its
    precision's fp32 masters, and the activations its audited step saved."""
    return account(
        trainer.task,
        trainer.optimizers.values(),
        trainer.precision.master.masters.values(),
        trainer.meter.activations.by_dtype,
        trainer.device,
    )
