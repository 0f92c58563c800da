"""precision.autopilot's keys (runner/precision/autopilot.py decides with them): their defaults
sit below what clean runs of each format reach (scripts/autopilot_ranges.py; the figures in
docs/precision-modes.md). Light: the command line is checked before torch loads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AutopilotConfig:
    """precision.autopilot (on with precision.autopilot=true, an alias of .enabled=true)."""

    enabled: bool = False
    every_n_steps: int = 25
    # a unit's SQNR (dB) under its format's floor moves it to bf16
    sqnr_floor_db: dict[str, float] = field(
        default_factory=lambda: {"fp8": 15.0, "mxfp8": 18.0, "nvfp4": 6.0, "mxfp4": 6.0}
    )
    # an operand's share of nonzero elements flushed to zero over its format's ceiling moves it
    flushed_ceiling: dict[str, float] = field(
        default_factory=lambda: {"fp8": 0.1, "mxfp8": 0.1, "nvfp4": 0.6, "mxfp4": 0.6}
    )
    sqnr_drop_db: float = 8.0  # a fall below the median of the unit's own earlier SQNRs
    final_bf16: float = 0.0  # the share of the run's last steps every unit runs in bf16
