"""precision=fp16: fp32 weights, fp16 autocast and dynamic loss scaling."""

import torch

from runner.precision.modes.base import Mode

MODE = Mode("fp16", compute="fp16", autocast=torch.float16, scales_loss=True)
