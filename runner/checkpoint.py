"""Saving and resuming: atomic writes, loads that never run pickled code, RNG states, and finding
the checkpoint to resume from."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np
import torch

from runner import console
from runner.errors import UserError, first_line

STEP_FILE = re.compile(r"step-(\d+)\.pt")


def save(path: Path, state: dict) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: a reader (or a resume
    after a crash) sees the previous checkpoint or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(
            f"cannot write checkpoint {path}: {e.strerror or e}; the previous checkpoint is intact"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)


def load(path: Path) -> dict:
    """`weights_only=True`: tensors, numbers, strings and containers only; a pickled payload is
    refused, never run."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"checkpoint not found: {path}") from None
    except Exception as e:  # a truncated zip, or a payload weights_only refuses
        raise UserError(f"checkpoint {path} cannot be loaded safely: {first_line(e)}") from None
    if not isinstance(state, dict) or not {"model", "optimizer", "step"} <= state.keys():
        raise UserError(f"checkpoint {path} is not an amp-runner checkpoint")
    return state


def prune(folder: Path, keep: int) -> None:
    """Keep the newest `keep` step-N.pt files (and their shards)."""
    steps = sorted(
        (int(m.group(1)), p) for p in folder.glob("step-*.pt") if (m := STEP_FILE.fullmatch(p.name))
    )
    for _, path in steps[:-keep]:
        for shard in folder.glob(f"{path.stem}.shard*.pt"):
            shard.unlink(missing_ok=True)
        path.unlink(missing_ok=True)


def shard_path(path: Path, rank: int) -> Path:
    """Rank r's file of a sharded checkpoint (trainer.strategy=fsdp): last.shard1.pt, ..."""
    return path if rank == 0 else path.with_name(f"{path.stem}.shard{rank}.pt")


def own_shard(path: Path, state: dict, rank: int, world: int) -> dict:
    """This rank's part of the checkpoint at `path`: the file itself unless it is sharded."""
    shards = state.get("shards")
    if not shards:
        return state
    if shards != world:
        raise UserError(
            f"checkpoint {path} is sharded over {shards} ranks: resume it with {shards} "
            f"(this run has {world})"
        )
    own = load(shard_path(path, rank)) if rank else state
    if own["step"] != state["step"]:
        raise UserError(
            f"checkpoint {path}: rank {rank}'s shard is from step {own['step']}, not {state['step']}"
        )
    return own


def find_resume(spec: str | None, run_dir: Path) -> tuple[Path, dict] | None:
    """`auto`: the newest checkpoint in the run directory that loads (a damaged one is skipped
    with a warning), or None for a fresh start. A path: that checkpoint, or an error."""
    if not spec:
        return None
    if spec != "auto":
        path = Path(spec).expanduser()
        return path, load(path)
    # Newest first by file name alone, so that only one checkpoint is read when it is good
    # (checkpoints can be gigabytes): last.pt, then step-N.pt by N descending. Shards
    # (*.shardK.pt) match neither pattern and are read through their rank-0 file.
    folder = run_dir / "checkpoints"
    steps = sorted(
        (
            (int(m.group(1)), p)
            for p in folder.glob("step-*.pt")
            if (m := STEP_FILE.fullmatch(p.name))
        ),
        reverse=True,
    )
    last = [folder / "last.pt"] if (folder / "last.pt").exists() else []
    found = _first_loading(last + [p for _, p in steps])
    if found and found[0] in last:
        # The trainer writes step-N.pt before last.pt, so a crash between the two leaves a step
        # file newer than last.pt that the name order alone would miss: only then a second read.
        return _first_loading([p for n, p in steps if n > found[1]["step"]]) or found
    return found


def _first_loading(paths: list[Path]) -> tuple[Path, dict] | None:
    """The first of `paths` that loads, warning about the ones that do not."""
    for path in paths:
        try:
            return path, load(path)
        except UserError as e:
            console.say(f"[yellow]warning:[/] skipping {path.name}: {e}")
    return None


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
