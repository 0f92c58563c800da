"""Test environment: offline, every cache and output in a temporary folder, small configs."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from runner.measure.contention import THRESHOLD_ENV
from runner.precision.caps import CPU_KIND_ENV, CPU_KINDS

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
# One CPU kind for the whole suite, whatever this machine is (the kinds' flags, runner/precision/
# caps.py): avx2 computes emulated bf16/fp16 matmuls in fp32, quick on every CPU. Tests whose
# result depends on the kind take the `cpu_kind` fixture and run under each. `AMP_RUNNER_CPU_KIND=
# amx make test` runs the whole suite as that kind would (native: this machine's own).
os.environ.setdefault(CPU_KIND_ENV, "avx2")
# No run of the suite's is contended (runner/measure/contention.py): the suite shares its machine
# (two workers, other jobs), and a contended run's speed and MFU are left out. The tests of
# contention itself (tests/test_contention.py) set the real threshold.
os.environ.setdefault(THRESHOLD_ENV, "0")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Tests in parallel (pytest -n N): one thread per worker and its subprocesses, or their
    # oversubscribed BLAS threads spin and slow every test many times over.
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    # torch is imported above, before these are read: set its count too. One thread, so no
    # run of the suite's takes fewer (runner/train/threads.py): a run and its reference loop
    # compute in the same order, whatever else loads the machine.
    import torch

    torch.set_num_threads(1)


@pytest.fixture(params=list(CPU_KINDS))
def cpu_kind(request, monkeypatch) -> str:
    """The test runs once under each CPU kind, as that kind's process would see it."""
    monkeypatch.setenv(CPU_KIND_ENV, request.param)
    return request.param


def pytest_collection_modifyitems(config, items):
    """Tests under each CPU kind carry the `cpu_kind` marker (`pytest -m cpu_kind` runs them).
    `gpu` tests run where CUDA is (scripts/gpu_check.sh); elsewhere they are skipped."""
    import torch

    for item in items:
        if "cpu_kind" in getattr(item, "fixturenames", ()):
            item.add_marker("cpu_kind")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: run scripts/gpu_check.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
