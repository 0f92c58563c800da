"""A precision mode is one module: a toy mode declared and registered here, outside
runner/precision/modes/, runs through the matrix's options (compile, an fp32 island, gradient
accumulation, checkpointing, both CPU kernels) with no change to the runner.

The toy: bf16 autocast, with the head's weights (its last Linear) held in bf16 as well."""

from __future__ import annotations

import math

import pytest
import torch

from runner.precision.modes import MODES, Mode, register
from runner.run import run
from tests.helpers import make_cfg, read_metrics
from tests.test_matrix import _name, _overrides

HEAD = "net.head."  # MatrixNet's last Linear, under the task


class Bf16Head(Mode):
    def convert(self, precision, model, islands, norms) -> None:
        for name, param in model.named_parameters():
            if name.startswith(HEAD):
                param.data = param.data.to(torch.bfloat16)

    def expects(self, cfg, row: dict) -> tuple[str, str]:
        if row["example"].startswith(HEAD):
            return "bf16", f"precision={self.name} holds the head's weights in bf16"
        return super().expects(cfg, row)


@pytest.fixture
def bf16_head():
    mode = register(Bf16Head("bf16_head", compute="bf16", autocast=torch.bfloat16))
    yield mode
    del MODES[mode.name]


# (strategy, compile, island, accumulate, checkpointing, cpu_kernels), as the matrix's rows
OPTIONS = [
    ("single", True, True, 2, False, "fast"),
    ("single", False, False, 1, True, "native"),
]


@pytest.mark.parametrize("options", OPTIONS, ids=[_name(("bf16_head", *o)) for o in OPTIONS])
def test_a_mode_registered_from_a_test_module_runs_through_the_matrix_options(
    bf16_head, options, tmp_path
):
    _, compiled, island, *_, kernels = options
    overrides = [*_overrides("bf16", *options), "precision.mode=bf16_head"]
    summary = run(make_cfg(*overrides), tmp_path)
    assert summary["status"] == "completed", summary.get("error")
    rows = read_metrics(tmp_path)
    assert [r["precision"] for r in rows] == ["bf16_head"] * len(rows)
    assert summary["skipped_steps"] == 0 and all(math.isfinite(r["loss"]) for r in rows)
    assert (summary["compiled_graphs"] >= 1) == compiled
    assert summary["cpu_kernels"] == ("fast" if kernels == "fast" else "native")
    if island:
        assert summary["fp32_ops"], summary
    # what the run held: the head's weight and bias in bf16, the rest in fp32
    by_dtype = summary["memory"]["params"]["by_dtype"]
    assert set(by_dtype) == {"bfloat16", "float32"}, by_dtype
    truth = summary["precision_truth"]
    head = [r for r in truth["rows"] if r["example"].startswith(HEAD)]
    assert head and all(r["weights"] == "bf16" for r in head), truth["rows"]
    assert all(r["weights"] == "fp32" for r in truth["rows"] if r not in head), truth["rows"]
    assert truth["autocast"] == "bf16" and truth["mismatches"] == [], truth
