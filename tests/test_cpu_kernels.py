"""precision.cpu_kernels: `fast` computes bf16/fp16 matmuls from their inputs in fp32 during a
run's fit, with the numerics of PyTorch's own (`native`) kernels; `auto` is native on a CPU with
bf16 units; nothing stays registered after a run, failed or not.

What ran is read from the profiler: under `fast` each low-precision matmul converts its inputs
(`aten::to` inside the op), under `native` it does not."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import profile

from runner.config.validation import validate
from runner.errors import UserError
from runner.run import run
from tests.helpers import TINY_BERT, TINY_MLP, make_cfg, read_metrics

OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward")
MATMULS = {f"aten::{op}" for op in OPS}
DTYPES = {"bf16": "c10::BFloat16", "fp16": "c10::Half"}
SHORT = ["trainer.log_every_n_steps=1", "trainer.val_check_interval=0"]


def converted(prof: profile, dtype: str, compiled: bool = False) -> list[bool]:
    """For each matmul the profiled code ran on `dtype` inputs (in compiled code only, with
    `compiled`): whether it converted its inputs to compute them. (Under the audit's dispatch
    mode an op shows twice: as called, holding the mode, and as run, inside it.)"""

    def in_compiled_code(event) -> bool:
        while event is not None and "CompiledFxGraph" not in event.name:
            event = event.cpu_parent
        return event is not None

    return [
        any(child.name == "aten::to" for child in event.cpu_children)
        for event in prof.events()
        if event.name in MATMULS
        and DTYPES[dtype] in event.input_dtypes
        and not any(child.name == "PythonDispatchMode" for child in event.cpu_children)
        and (not compiled or in_compiled_code(event))
    ]


def nothing_registered() -> bool:
    return not any(
        torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "BackendSelect") for op in OPS
    )


# (mode, loss, grad norm): relative tolerances per step. Under autocast the two agree to a few
# 1e-6 (loss) and 1e-4 (grad norm): tight enough to fail a kernel that truncates its outputs
# instead of rounding them. With bf16 gradients (bf16_true, and fp8's torchao matmuls) one unit
# of bf16's last place in a gradient moves the grad norm by up to 3e-3: the issue's 1e-2 holds.
AGREEMENT = [
    ("bf16", 1e-4, 1e-3),
    ("fp16", 1e-4, 1e-3),
    ("fp16_master", 1e-4, 1e-3),
    ("bf16_true", 1e-3, 1e-2),
    ("fp8", 1e-3, 1e-2),
]


@pytest.mark.parametrize(("mode", "loss_tol", "grad_tol"), AGREEMENT)
def test_fast_kernels_train_as_the_native_ones(tmp_path, mode, loss_tol, grad_tol):
    """Per step: the loss and the grad norm within tolerance, the loss scale identical."""
    summaries = {
        kernels: run(
            make_cfg(
                *TINY_BERT,
                *SHORT,
                f"precision={mode}",
                f"precision.cpu_kernels={kernels}",
                "trainer.max_steps=6",
            ),
            tmp_path / kernels,
        )
        for kernels in ("fast", "native")
    }
    assert [s["cpu_kernels"] for s in summaries.values()] == ["fast", "native"]
    fast, native = read_metrics(tmp_path / "fast"), read_metrics(tmp_path / "native")
    assert len(fast) == len(native) == 6
    for f, n in zip(fast, native, strict=True):
        assert f["loss"] == pytest.approx(n["loss"], rel=loss_tol)
        assert f["grad_norm"] == pytest.approx(n["grad_norm"], rel=grad_tol)
        assert f["loss_scale"] == n["loss_scale"]


@pytest.mark.parametrize("kernels", ["fast", "native"])
@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_fast_kernels_compute_low_precision_matmuls_from_fp32_inputs(tmp_path, mode, kernels):
    cfg = make_cfg(
        *TINY_MLP,
        *SHORT,
        f"precision={mode}",
        f"precision.cpu_kernels={kernels}",
        "trainer.max_steps=2",
    )
    with profile(record_shapes=True) as prof:
        run(cfg, tmp_path)
    seen = converted(prof, mode)
    assert seen, "no low-precision matmul ran"
    assert seen == [kernels == "fast"] * len(seen)


def test_fast_kernels_hold_in_compiled_code(tmp_path):
    """Dynamo compiles as without them, and Inductor's code (mm.out, addmm.out) computes its
    bf16 matmuls from fp32 inputs too, with the eager run's numerics."""
    common = [*TINY_BERT, *SHORT, "precision=bf16", "trainer.max_steps=4"]
    with profile(record_shapes=True) as prof:
        summary = run(
            make_cfg(*common, "precision.cpu_kernels=fast", "trainer.compile=true"),
            tmp_path / "compiled",
        )
    assert summary["compiled_graphs"] >= 1
    seen = converted(prof, "bf16", compiled=True)
    assert seen and all(seen)
    run(make_cfg(*common, "precision.cpu_kernels=native"), tmp_path / "native")
    compiled, native = read_metrics(tmp_path / "compiled"), read_metrics(tmp_path / "native")
    for c, n in zip(compiled, native, strict=True):
        assert c["loss"] == pytest.approx(n["loss"], rel=1e-3)


# The dtypes whose matmuls each CPU kind has units for (`auto` computes the others' in fp32).
NATIVE = {"avx2": set(), "avx512_bf16": {"bf16"}, "amx": {"bf16", "fp16"}}


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_auto_picks_the_kernels_each_cpu_kind_has_units_for(tmp_path, cpu_kind, mode):
    """precision.cpu_kernels=auto on each CPU kind (whatever this machine is): native where the
    CPU has units for the dtype, fast where it has not, as the profiler sees the matmuls run."""
    native = NATIVE[cpu_kind]
    cfg = make_cfg(*TINY_MLP, *SHORT, f"precision={mode}", "trainer.max_steps=2")
    with profile(record_shapes=True) as prof:
        summary = run(cfg, tmp_path)
    seen = converted(prof, mode)
    assert seen and seen == [mode not in native] * len(seen)
    assert summary["cpu_kernels"] == ("native" if mode in native else "fast")


class FailsAtThirdStep(nn.Linear):
    """The blobs' classifier, until its third forward."""

    def __init__(self):
        super().__init__(32, 8)
        self.calls = 0

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("the model broke")
        return super().forward(features)


def test_nothing_stays_after_a_run_or_a_failed_one(tmp_path):
    common = [*TINY_MLP, *SHORT, "precision=bf16", "precision.cpu_kernels=fast"]
    run(make_cfg(*common, "trainer.max_steps=2"), tmp_path / "done")
    assert nothing_registered()
    failing = [
        *common,
        "model=module",
        "model.net._target_=tests.test_cpu_kernels.FailsAtThirdStep",
        "dataset=blobs",
        "trainer.max_steps=5",
    ]
    with pytest.raises(RuntimeError, match="the model broke"):
        run(make_cfg(*failing), tmp_path / "failed")
    assert nothing_registered()
    a, b = torch.randn(64, 32).bfloat16(), torch.randn(32, 16).bfloat16()
    with profile(record_shapes=True) as prof:
        a @ b
    assert converted(prof, "bf16") == [False]


def test_a_bad_cpu_kernels_value_is_one_line():
    with pytest.raises(UserError, match=r"precision.cpu_kernels='quick' is invalid: allowed: auto"):
        validate(make_cfg(*TINY_MLP, "precision.cpu_kernels=quick"))
