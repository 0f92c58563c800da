"""Saving and loading checkpoints: atomic writes, and loads that never run pickled code."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from runner.errors import UserError


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
    finally:
        tmp.unlink(missing_ok=True)


def load(path: Path) -> dict:
    """`weights_only=True`: tensors, numbers, strings and containers only."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"checkpoint not found: {path}") from None
    except Exception as e:  # a truncated zip, or a payload weights_only refuses
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {path} cannot be loaded safely: {first}") from None
