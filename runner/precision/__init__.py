"""Everything about numeric precision: what a device supports (`caps`), the mode in force and its
autocast, scaler and TF32 settings (`plan`), the optimizer step's order (`step`), fp16_master's
fp32 master weights (`master`), bf16_true's bf16 model and update rounding (`bf16_true`) and fp32
islands (`islands`). The loop sees only `Precision`."""

from runner.precision.caps import DeviceCaps, compute_mode
from runner.precision.plan import AUTOCAST_DTYPES, Precision
from runner.precision.step import StepResult, steps_on_device

__all__ = [
    "AUTOCAST_DTYPES",
    "DeviceCaps",
    "Precision",
    "StepResult",
    "compute_mode",
    "steps_on_device",
]
