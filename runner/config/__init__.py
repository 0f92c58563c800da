"""The configuration: the schemas of the runner-owned groups (schema.py), the checks Hydra's types
cannot express (validation.py, with optim.py and tasks.py for the optimizer and the task groups),
and the command line's checks before Hydra runs it (commandline.py, preflight.py).

Importing this package is light (no torch): the entry point checks a command line with it before
anything heavy loads. `validate` lives in runner.config.validation, which imports the modes."""

from runner.config.schema import (
    Config,
    Fp8Config,
    GradScalerConfig,
    PrecisionConfig,
    RunnerConfig,
    StageConfig,
    register,
)

__all__ = [
    "Config",
    "Fp8Config",
    "GradScalerConfig",
    "PrecisionConfig",
    "RunnerConfig",
    "StageConfig",
    "register",
]
