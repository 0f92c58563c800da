"""precision=mxfp4: the OCP Microscaling FP4 format, emulated: E2M1 in blocks of 32 with an E8M0
(power-of-two) scale per block, rounded to nearest, on the Linears the converting modes' chooser
picks (read from precision.fp4; conf/precision/mxfp4.yaml turns NVFP4's recipe switches off);
bf16 autocast for the rest (runner/precision/fp4.py)."""

import torch

from runner.precision.modes.nvfp4 import Fp4

MODE = Fp4("mxfp4", compute="mxfp4", autocast=torch.bfloat16, converts=True, mfu_also_vs="bf16")
