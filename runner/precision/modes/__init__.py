"""The precision modes, one module each, registered by name in `MODES`. A mode from elsewhere (a
test's, a user's) joins with `register`; config validation and every part of the run then
accept it by its name."""

from __future__ import annotations

from runner.errors import UserError
from runner.precision.modes import (
    bf16,
    bf16_true,
    fp8,
    fp16,
    fp16_master,
    fp32,
    mxfp4,
    mxfp8,
    nvfp4,
    tf32,
)
from runner.precision.modes.base import Mode

# in the order `precision.mode`'s error message lists them
MODES: dict[str, Mode] = {}


def register(mode: Mode) -> Mode:
    """Adds `mode` under its name (a name taken is an error: one module per mode)."""
    if mode.name in MODES or mode.name in ("auto", "staged"):
        raise ValueError(f"precision mode {mode.name!r} is already registered")
    MODES[mode.name] = mode
    return mode


for _module in (fp32, tf32, fp16, bf16, fp8, mxfp8, nvfp4, mxfp4, fp16_master, bf16_true):
    register(_module.MODE)


def mode_of(name: str) -> Mode:
    """The mode registered as `name` (a resolved one: not auto or staged)."""
    if name not in MODES:
        raise UserError(f"precision.mode={name!r} is not a precision mode ({', '.join(MODES)})")
    return MODES[name]


def choices(stage: bool = False) -> tuple[str, ...]:
    """The names `precision.mode` accepts; `stage`: those a staged schedule's stages accept."""
    stageable = tuple(n for n, m in MODES.items() if m.stageable)
    if stage:
        return (*stageable, "auto")
    return (*stageable, "auto", "staged", *(n for n, m in MODES.items() if not m.stageable))


__all__ = ["MODES", "Mode", "choices", "mode_of", "register"]
