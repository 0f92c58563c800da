"""Several ranks change how a step is computed, never what it computes: FSDP runs the numerics
of DDP for the same precision mode, and `precision.reduce_dtype` is honoured by both."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tests.helpers import TINY_BERT, read_metrics
from tests.test_distributed import run_ranks

STEPS = [
    *TINY_BERT,
    "dataset.batch_size=4",
    "trainer.max_steps=3",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=0",
    "optim.optimizer.eps=1e-4",
]


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
def test_fsdp_trains_like_ddp_in_bf16_and_reduce_dtype_is_honoured(tmp_path):
    """BERT has LayerNorms inside its shard units and word embeddings tied to the MLM decoder:
    FSDP keeps both fp32 as autocast does under DDP, so the two strategies agree to rounding."""
    bf16 = [*STEPS, "precision=bf16"]
    jobs = {
        "ddp": [*bf16, "trainer.strategy=ddp"],
        "fsdp": [*bf16, "trainer.strategy=fsdp"],
        "ddp_bf16_reduce": [*bf16, "trainer.strategy=ddp", "precision.reduce_dtype=bf16"],
        "fsdp_bf16_reduce": [*bf16, "trainer.strategy=fsdp", "precision.reduce_dtype=bf16"],
    }
    run_ranks([(overrides, tmp_path / name) for name, overrides in jobs.items()])
    rows = {name: read_metrics(tmp_path / name) for name in jobs}
    for a, b in zip(rows["ddp"], rows["fsdp"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    for strategy in ("ddp", "fsdp"):  # bf16 sums round: close to fp32's, but not equal
        grads = [r["grad_norm"] for r in rows[strategy]]
        rounded = [r["grad_norm"] for r in rows[f"{strategy}_bf16_reduce"]]
        assert rounded == pytest.approx(grads, rel=2e-2) and rounded != grads


def record_all_reduces(rank: int) -> Callable[[], dict]:
    """A spy on torch.distributed.all_reduce (it still runs): the size of each tensor sent."""
    import torch.distributed as dist

    sizes, all_reduce = [], dist.all_reduce

    def recording(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording

    def figures() -> dict:
        taken = sizes[:]
        sizes.clear()
        return {"all_reduce_sizes": taken}

    return figures


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
def test_fp16_master_averages_its_fp32_gradients_over_ranks(tmp_path):
    """fp16_master is not DDP-wrapped: it averages its fp32 master gradients itself, once per
    window, all of them flattened into one all-reduce (this model is far below a bucket).
    2 ranks × batch 4 × 2 micro-batches ≡ 1 process × batch 8 × 2, to fp16 rounding."""
    from runner.run import run
    from tests.helpers import TINY_MLP, make_cfg

    common = [
        *TINY_MLP,
        "precision=fp16_master",
        "trainer.max_steps=4",
        "trainer.accumulate_grad_batches=2",
        "trainer.log_every_n_steps=1",
        "trainer.val_check_interval=0",
        "optim.optimizer.eps=1e-4",
    ]
    [reports] = run_ranks(
        [([*common, "dataset.batch_size=4"], tmp_path / "ddp")], spy=record_all_reduces
    )
    run(make_cfg(*common, "dataset.batch_size=8"), tmp_path / "one")
    parameters = json.loads((tmp_path / "ddp" / "summary.json").read_text())["parameters"]
    # the others are the step's scalars: token count and preemption flag, losses
    sent = [n for n in reports[0]["all_reduce_sizes"] if n > 2]
    assert sent == [parameters] * 4
    for a, b in zip(read_metrics(tmp_path / "ddp"), read_metrics(tmp_path / "one"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)
