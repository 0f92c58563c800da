"""precision=bf16: fp32 weights and bf16 autocast (bf16's range needs no loss scaling)."""

import torch

from runner.precision.modes.base import Mode

MODE = Mode("bf16", compute="bf16", autocast=torch.bfloat16)
