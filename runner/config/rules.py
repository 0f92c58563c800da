"""The primitives of config validation: a failed check is one UserError line naming the key,
its value and what is allowed."""

from __future__ import annotations

import math
from typing import Any

from runner.errors import UserError, clip


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise UserError(f"{key}={clip(repr(value))} is invalid: {allowed}")


def number(value: Any) -> bool:
    """A finite int or float: a typo arrives as a string (lr=abc), and a bool is an int."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def choices(group: str) -> list[str]:
    """The options of one of conf/'s config groups (precision: fp32, bf16, ...)."""
    from runner import CONF_DIR

    return sorted(f.stem for f in (CONF_DIR / group).glob("*.yaml"))
