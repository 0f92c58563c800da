"""The pairwise feature matrix: every pair of {precision} × {compile} × {fp32 island} ×
{accumulation} × {single process, DDP, FSDP} × {gradient checkpointing} × {CPU kernels} runs
together in at least one tiny run of a user's net (`model=module`), and each run checks what its
options promise:
graphs compiled when compile is on, the island in fp32 (its module refuses to run otherwise, in
the forward and in a checkpointed block's recomputation), low-precision matmuls computed in fp32
where the CPU kernels are fast (and never in fp32 runs), a finite loss with no skipped step, the
loss scale where fp16 scales (carried across a staged run's bf16 stage), and fp32 runs that match
the single-process reference step for step (the same global batch of 16 in every run)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from runner.run import run
from tests.helpers import make_cfg, read_metrics
from tests.test_distributed import WORLD, run_ranks

GLOBAL_BATCH = 16
STEPS = 6
INIT_SCALE = 1024.0
# fp32 → fp16 → bf16 → fp16: islands hold in stages after a first one that does not autocast,
# and the scaler carries its scale across the bf16 stage
STAGE_MODES = ["fp32", "fp16", "fp16", "bf16", "fp16", "fp16"]  # by step
STAGES = (
    "precision.stages=[{mode:fp32,until_step:1},{mode:fp16,until_step:3},"
    "{mode:bf16,until_step:4},{mode:fp16}]"
)

# (precision, strategy, compile, island, accumulate, checkpointing, cpu_kernels): all pairs of
# values covered.
# Two pairs are refused, so left out: FSDP with fp16_master (FSDP's fp32 shards are already the
# master weights) and with bf16_true (FSDP2 gathers one dtype per unit).
REFUSED = {("fp16_master", "fsdp"), ("bf16_true", "fsdp")}
MATRIX = [
    ("fp32", "single", False, False, 1, False, "native"),
    ("fp32", "ddp", True, True, 1, True, "fast"),
    ("fp32", "fsdp", False, True, 2, True, "fast"),
    ("bf16", "single", True, True, 2, False, "fast"),
    ("bf16", "ddp", False, False, 2, True, "fast"),
    ("bf16", "fsdp", True, False, 1, False, "native"),
    ("fp16", "single", False, True, 1, True, "fast"),
    ("fp16", "ddp", True, False, 2, False, "fast"),
    ("fp16", "fsdp", True, True, 2, True, "native"),
    ("staged", "single", True, False, 2, True, "native"),
    ("staged", "ddp", False, True, 2, False, "fast"),
    ("staged", "fsdp", False, False, 1, True, "native"),
    ("fp16_master", "single", True, True, 1, False, "native"),
    ("fp16_master", "ddp", False, False, 2, True, "fast"),
    ("bf16_true", "single", True, True, 1, False, "native"),
    ("bf16_true", "ddp", False, False, 2, True, "fast"),
    ("fp8", "single", True, False, 2, True, "native"),
    ("fp8", "ddp", False, True, 1, False, "native"),
    ("fp8", "fsdp", False, True, 2, False, "fast"),
    ("mxfp8", "single", True, True, 1, False, "fast"),
    ("mxfp8", "ddp", False, False, 2, True, "native"),
    ("mxfp8", "fsdp", False, True, 2, False, "fast"),
]


class Fp32Island(nn.Linear):
    """A Linear that refuses to run anywhere but in an fp32 island: autocast off, fp32 input,
    fp32 weight (under FSDP: gathered in fp32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            torch.is_autocast_enabled(x.device.type)
            or x.dtype != torch.float32
            or self.weight.dtype != torch.float32
        ):
            raise AssertionError(
                f"net.blocks.0 ran outside its fp32 island: autocast "
                f"{torch.is_autocast_enabled(x.device.type)}, input {x.dtype}, "
                f"weight {self.weight.dtype}"
            )
        return super().forward(x)


class MatrixNet(nn.Module):
    """A user's MLP for the blobs data: blocks of Linear + GELU and a head. With `island`, its
    first layer checks that it runs as an fp32 island (under FSDP the island, one of the blocks,
    must be sharded apart in fp32)."""

    def __init__(self, island: bool = False, width: int = 64, features: int = 32, classes: int = 8):
        super().__init__()
        first = (Fp32Island if island else nn.Linear)(features, width)
        self.blocks = nn.Sequential(first, nn.GELU(), nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(features))


def _overrides(
    precision, strategy, compiled, island, accumulate, checkpointing, kernels
) -> list[str]:
    world = 1 if strategy == "single" else WORLD
    out = [
        "model=module",
        "model.net._target_=tests.test_matrix.MatrixNet",
        f"+model.net.island={str(island).lower()}",
        f"model.gradient_checkpointing={str(checkpointing).lower()}",
        "dataset=blobs",
        "dataset.num_samples=1024",
        "trainer.progress_bar=false",
        "logger=none",
        f"precision={precision}",
        f"precision.cpu_kernels={kernels}",
        f"trainer.compile={str(compiled).lower()}",
        f"trainer.accumulate_grad_batches={accumulate}",
        f"dataset.batch_size={GLOBAL_BATCH // world // accumulate}",
        f"trainer.max_steps={STEPS}",
        "trainer.log_every_n_steps=1",
        "trainer.val_check_interval=0",
        "optim.scheduler.decay=constant",
        "optim.optimizer.eps=1e-4",  # Adam keeps rounding noise a rounding error
        f"precision.grad_scaler.init_scale={INIT_SCALE}",
        "precision.grad_scaler.growth_interval=1",  # the scale doubles on every applied step
    ]
    if strategy != "single":
        out.append(f"trainer.strategy={strategy}")
    if precision == "staged":
        out.append(STAGES)
    if precision in ("fp8", "mxfp8"):  # blocks.2 converts (the first and last Linear stay bf16)
        out.append("precision.fp8.min_features=16")
    if island:
        out.append("precision.fp32_modules=[net.blocks.0]")
    return out


def _name(row) -> str:
    precision, strategy, compiled, island, accumulate, checkpointing, kernels = row
    return (
        f"{precision}-{strategy}-{'compiled' if compiled else 'eager'}-"
        f"{'island' if island else 'noisland'}-acc{accumulate}"
        f"{'-checkpointed' if checkpointing else ''}-{kernels}"
    )


def _expected_scales(precision: str) -> list[float] | None:
    """The loss scale each step ran with: it doubles after every fp16 step."""
    modes = {
        "fp16": ["fp16"] * STEPS,
        "fp16_master": ["fp16"] * STEPS,
        "staged": STAGE_MODES,
    }.get(precision)
    if modes is None:
        return None
    scales, scale = [], INIT_SCALE
    for mode in modes:
        scales.append(scale if mode == "fp16" else 1.0)
        scale *= 2 if mode == "fp16" else 1
    return scales


@pytest.fixture(scope="module")
def matrix_runs(tmp_path_factory):
    """Runs the whole matrix once: single-process rows here, distributed rows in one pair of
    rank processes (one start-up for all of them)."""
    root = tmp_path_factory.mktemp("matrix")
    summaries = {}
    for row in MATRIX:
        if row[1] == "single":  # a run that fails fails its own row only
            try:
                summaries[row] = run(make_cfg(*_overrides(*row)), root / _name(row))
            except Exception as e:
                summaries[row] = e
    try:  # the ranks run the jobs in order: a failed job stops them, and fails the rows left
        run_ranks([(_overrides(*row), root / _name(row)) for row in MATRIX if row[1] != "single"])
    except AssertionError as e:
        failure = e
    else:
        failure = None
    for row in MATRIX:
        summary = root / _name(row) / "summary.json"
        if row[1] != "single":
            summaries[row] = (
                json.loads(summary.read_text())
                if summary.exists()
                else AssertionError(f"no summary: the rank processes failed ({failure})")
            )
    return root, summaries


@pytest.mark.slow  # its rows start ranks, one after another: make test-slow and CI run it
@pytest.mark.xdist_group("matrix")  # one worker runs the whole matrix once (pytest -n)
@pytest.mark.parametrize("row", MATRIX, ids=[_name(r) for r in MATRIX])
def test_every_option_keeps_its_word_next_to_the_others(matrix_runs, row):
    precision, strategy, compiled, island, accumulate, _, kernels = row
    root, summaries = matrix_runs
    summary = summaries[row]
    if isinstance(summary, Exception):
        raise summary
    assert summary["status"] == "completed", summary.get("error")
    rows = read_metrics(root / _name(row))
    assert summary["status"] == "completed"
    assert summary["world_size"] == (1 if strategy == "single" else WORLD)
    assert summary["skipped_steps"] == 0 and all(math.isfinite(r["loss"]) for r in rows)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    if compiled:
        assert summary["compiled_graphs"] >= 1, "compile on, nothing compiled"
    else:
        assert summary["compiled_graphs"] == 0
    # what ran the low-precision matmuls (the fast kernels count what they compute in fp32)
    assert summary["cpu_kernels"] == (
        "fast" if kernels == "fast" and precision != "fp32" else "native"
    )
    if island and precision != "fp32":  # the audited first step ran the island's matmuls in fp32
        assert summary["fp32_ops"], summary
    expected = _expected_scales(precision)
    if expected is not None:
        assert [r["loss_scale"] for r in rows] == expected
    if precision == "staged":
        assert [r["precision"] for r in rows] == STAGE_MODES
    if precision in ("fp8", "mxfp8"):  # one layer in fp8; ranks of b match one process of 2b
        assert summary["converted"]["converted"] == ["net.blocks.2"]
        assert summary["converted"]["converted_flops_per_step"] > 0
        single = read_metrics(
            root / _name(next(r for r in MATRIX if r[:2] == (precision, "single")))
        )
        for got, want in zip(rows, single, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=2e-2)
    if precision == "bf16_true":  # bf16 weights; the island's stay fp32
        weights = summary["memory"]["params"]["by_dtype"]
        assert set(weights) == ({"bfloat16", "float32"} if island else {"bfloat16"}), weights
    if precision == "fp32":  # the math says every fp32 run equals the reference
        reference = read_metrics(root / _name(MATRIX[0]))
        for got, want in zip(rows, reference, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def test_the_matrix_covers_every_pair():
    width = len(MATRIX[0])
    values = [sorted({r[i] for r in MATRIX}, key=str) for i in range(width)]
    for i in range(width):
        for j in range(i + 1, width):
            seen = {(r[i], r[j]) for r in MATRIX}
            missing = [
                (a, b)
                for a in values[i]
                for b in values[j]
                if (a, b) not in seen and (a, b) not in REFUSED
            ]
            assert not missing, (i, j, missing)
