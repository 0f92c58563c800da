"""precision=fp32: fp32 weights and arithmetic, no autocast (the reference)."""

from runner.precision.modes.base import Mode

MODE = Mode("fp32", compute="fp32")
