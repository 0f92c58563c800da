"""The random number generators' states a checkpoint holds (Python's, NumPy's, torch's, CUDA's,
and the run's own streams: nvfp4's stochastic rounding), every rank's, so that a resumed run draws
the same dropout masks, batches and roundings as one that never stopped."""

from __future__ import annotations

import random

import numpy as np
import torch

from runner import console
from runner.train import distributed
from runner.train.distributed import Dist


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


def rng_states(dist: Dist, streams: dict | None = None) -> dict:
    """This process's RNG states, and with several ranks every rank's (dropout differs by rank),
    gathered for rank 0 to save; `streams`: its generators beyond the global ones (nvfp4's
    stochastic rounding: {name: state}), every rank's in `streams_by_rank`. Every rank must call
    it."""
    pairs = distributed.gather((rng_state(), streams or {}), dist)
    states = [rng for rng, _ in pairs]
    return {
        "rng": states[dist.rank],
        **({"rng_by_rank": states} if dist.enabled else {}),
        "streams_by_rank": [mine for _, mine in pairs],
    }


def restore_rng(state: dict, dist: Dist) -> dict | None:
    """Sets this rank's RNG states from the checkpoint; returns its `streams` for their owners to
    restore: None where the checkpoint has none (written before they were saved), {} where it was
    written by another number of ranks (each rank's generators then start from their seeds, rather
    than every rank drawing rank 0's stream)."""
    by_rank = state.get("rng_by_rank") or []
    if dist.enabled and len(by_rank) != dist.world:
        console.say(
            f"[yellow]warning:[/] the checkpoint was written by {len(by_rank) or 1} rank(s), "
            f"this run has {dist.world}: dropout's and stochastic rounding's random streams "
            "will differ"
        )
    set_rng_state(by_rank[dist.rank] if len(by_rank) == dist.world else state["rng"])
    streams = state.get("streams_by_rank")
    if streams is None:
        return None
    if len(streams) == dist.world:
        return streams[dist.rank]
    return {} if dist.enabled else streams[0]  # one process continues rank 0's
