"""precision=tf32: fp32 weights, fp32 matmuls and convolutions computed in TF32."""

from runner.precision.modes.base import Mode

MODE = Mode("tf32", compute="tf32", tf32=True)
