"""Test environment: offline, every cache and output in a temporary folder, small configs."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Before anything imports datasets or wandb: they read these at import time.
_ROOT = Path(tempfile.mkdtemp(prefix="amp-runner-tests-"))
os.environ.update(
    HF_HUB_OFFLINE="1",
    HF_DATASETS_OFFLINE="1",
    WANDB_MODE="offline",
    WANDB_DIR=str(_ROOT / "wandb"),
    WANDB_CACHE_DIR=str(_ROOT / "wandb-cache"),
    WANDB_CONFIG_DIR=str(_ROOT / "wandb-config"),
    HF_DATASETS_CACHE=str(_ROOT / "hf-datasets"),
    AMP_RUNNER_CACHE=str(_ROOT / "amp-runner-cache"),
)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Tests in parallel (pytest -n N): one thread per worker and its subprocesses, or their
    # oversubscribed BLAS threads spin and slow every test many times over.
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run where CUDA is (scripts/gpu_check.sh); elsewhere they are skipped."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: run scripts/gpu_check.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
