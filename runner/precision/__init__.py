"""Everything about numeric precision: what each mode is (`modes`, one module a mode), what a
device supports (`caps`), the stages in force and their TF32 settings (`plan`), the loss scaler
(`scaler`), the optimizer step's order (`step`), fp16_master's fp32 master weights (`master`),
bf16_true's bf16 model and update rounding (`bf16_true`) and fp32 islands (`islands`). The loop
sees only `Precision`."""

from runner.precision.caps import DeviceCaps
from runner.precision.modes import MODES, Mode, mode_of
from runner.precision.plan import Precision
from runner.precision.step import StepResult, steps_on_device

__all__ = [
    "MODES",
    "DeviceCaps",
    "Mode",
    "Precision",
    "StepResult",
    "mode_of",
    "steps_on_device",
]
