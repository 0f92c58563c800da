"""Sharded checkpoints (trainer.strategy=fsdp): the model and optimizers written by every rank at
once with torch.distributed.checkpoint (DCP), which reshards on load, so a set written by N ranks
resumes on any number of them, one process included.

DCP's own reader unpickles a set's `.metadata` with plain `pickle.load`, and the optimizer's
non-tensor values with an unrestricted `torch.load`: a hostile folder would run code. Here the
metadata goes through an unpickler that admits DCP's metadata classes only, and the values
through `weights_only=True`; the tensors DCP already reads with `weights_only=True`."""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from runner.errors import UserError, first_line

# DCP writes it last, on rank 0, once every rank's shard is on disk: a set without it is
# incomplete (its save did not finish), one with it is whole.
COMMIT = ".metadata"

_METADATA_CLASSES = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by name: torch.strided
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, torch.Size and dtypes; any other global is refused, so a
    payload (os.system, ...) is never called."""

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")


def read_metadata(folder: Path) -> Metadata:
    """A set's metadata, unpickled safely. A set without it did not finish saving."""
    try:
        with open(folder / COMMIT, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise UserError(f"checkpoint {folder} is incomplete: its save did not finish") from None
    except Exception as e:
        raise UserError(f"checkpoint {folder} cannot be loaded safely: {first_line(e)}") from None
    storage = metadata.storage_data if isinstance(metadata, Metadata) else None
    # Each shard's file must be one in the set's folder, not a path elsewhere.
    if not isinstance(storage, dict) or not all(
        isinstance(s, _StorageInfo) and s.relative_path == Path(s.relative_path).name
        for s in storage.values()
    ):
        raise UserError(f"checkpoint {folder} cannot be loaded safely: its metadata is not DCP's")
    return metadata


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(Path(self.path))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        """The optimizer's hyperparameters (numbers, strings, tuples): weights_only."""
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _cause(e: BaseException) -> str:
    """The first rank's error inside a CheckpointException (whose text is every traceback)."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    return first_line(e)


@contextlib.contextmanager
def _one_process_is_no_news():
    """DCP warns whenever one process saves or loads a set; here that is a supported case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        yield


def module_states(task: torch.nn.Module, optimizers: list) -> dict:
    """The model's and optimizers' state keyed by parameter name, each rank's shards as DTensors:
    what DCP saves and reshards. Every rank must call it."""
    model, optimizer = get_state_dict(task, optimizers)
    return {"model": model, "optimizer": optimizer}


def save(folder: Path, modules: dict, distributed: bool) -> None:
    """Every rank writes its shards into `folder`; rank 0 then commits the set (COMMIT)."""
    try:
        with _one_process_is_no_news():
            dcp.save(modules, storage_writer=FileSystemWriter(folder), no_dist=not distributed)
    except (Exception, CheckpointException) as e:
        raise UserError(
            f"cannot write checkpoint {folder}: {_cause(e)}; the previous checkpoint is intact"
        ) from None


def load(folder: Path, task: torch.nn.Module, optimizers: list) -> None:
    """The model and optimizers from a set, resharded to this run's layout: FSDP over any number
    of ranks, DDP, or one process. Every rank must call it."""
    params = set(task.parameters())
    if any(p not in params for opt in optimizers for g in opt.param_groups for p in g["params"]):
        raise UserError(
            "a sharded checkpoint cannot resume precision=fp16_master (its optimizer updates "
            "fp32 copies of the weights): resume it with the precision it was written in"
        )
    try:
        states = module_states(task, optimizers)
        with _one_process_is_no_news():
            dcp.load(
                states,
                storage_reader=_SafeReader(folder),
                planner=_SafePlanner(),
                no_dist=not dist.is_initialized(),
            )
        set_state_dict(
            task,
            optimizers,
            model_state_dict=states["model"],
            optim_state_dict=states["optimizer"],
        )
    except UserError:
        raise
    except (Exception, CheckpointException) as e:
        raise UserError(f"the checkpoint does not fit this run: {_cause(e)}") from None


def load_whole(model: dict, optimizers: dict, saved: dict, task: torch.nn.Module) -> None:
    """A single-file checkpoint (one process or DDP) into FSDP shards: every rank holds the
    whole state and keeps its part. `saved`: each optimizer's state_dict by name."""
    names = {param: name for name, param in task.named_parameters()}
    merged: dict = {"state": {}, "param_groups": []}
    for key, optimizer in optimizers.items():
        # torch numbers an optimizer's parameters in its groups' order; DCP names them.
        order = [names[p] for group in optimizer.param_groups for p in group["params"]]
        state = saved[key]
        merged["state"].update({order[i]: s for i, s in state["state"].items()})
        merged["param_groups"] += [
            {**group, "params": [order[i] for i in group["params"]]}
            for group in state["param_groups"]
        ]
    try:
        set_state_dict(
            task,
            list(optimizers.values()),
            model_state_dict=model,
            optim_state_dict=merged,
            options=StateDictOptions(full_state_dict=True),
        )
    except (KeyError, IndexError, RuntimeError, ValueError) as e:
        raise UserError(f"the checkpoint does not fit this run: {first_line(e)}") from None
