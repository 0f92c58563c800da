"""DDP on the CPU: real processes joined by gloo, each calling `run` as torchrun's workers do."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY_BERT, TINY_MLP, cli, load_last, make_cfg, read_metrics

WORLD = 2
PATIENCE_S = 600  # for a loaded machine: a wait ends as soon as what it waits for is done


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, jobs: list[tuple[list[str], str]], count_syncs: bool) -> None:
    """One rank: runs each (overrides, run dir) job in turn, as `torchrun -m runner` would."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    from runner import distributed
    from runner.errors import Preempted
    from runner.run import run

    syncs = []
    if count_syncs:  # a spy on DDP's gradient all-reduce: it still runs
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp = torch.nn.parallel.DistributedDataParallel
        init = ddp.__init__

        def counting_hook(state, bucket):
            syncs.append(1)
            return allreduce_hook(state, bucket)

        def counting_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.register_comm_hook(None, counting_hook)

        ddp.__init__ = counting_init
    try:
        for overrides, out in jobs:
            syncs.clear()
            try:
                run(make_cfg(*overrides), out)
                outcome = "completed"
            except Preempted:
                outcome = "preempted"
            Path(out, f"rank{rank}.json").write_text(
                json.dumps({"syncs": len(syncs), "outcome": outcome})
            )
    finally:
        distributed.close(distributed.from_env())


def run_ranks(jobs: list[tuple[list[str], Path]], count_syncs=False, on_start=None) -> list:
    """Starts WORLD ranks on `jobs`, waits for them; returns each job's per-rank reports."""
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    jobs = [(list(o), str(d)) for o, d in jobs]
    procs = [context.Process(target=_rank, args=(r, port, jobs, count_syncs)) for r in range(WORLD)]
    for p in procs:
        p.start()
    if on_start:
        on_start(procs)
    for p in procs:
        p.join(timeout=PATIENCE_S)
        if p.exitcode is None:
            for q in procs:
                q.kill()
        assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    return [
        [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(WORLD)] for _, d in jobs
    ]


LOG_EACH = ["trainer.log_every_n_steps=1"]
FP32_BERT = [*TINY_BERT, "precision=fp32", *LOG_EACH]


def test_two_ranks_equal_one_process_with_the_global_batch(tmp_path):
    """2 ranks × batch 4 × 2 micro-batches ≡ 1 process × batch 8 × 2: the loss is normalised by
    the masked tokens of the whole global window, and the ranks deal out one sample stream."""
    steps = ["trainer.max_steps=4", "trainer.accumulate_grad_batches=2"]
    # Attention's key bias has a zero gradient, so both runs hold only rounding noise there, and
    # Adam turns noise into full-size steps (m/√v ≈ ±1); a larger eps keeps it a rounding error.
    steps.append("optim.optimizer.eps=1e-4")
    run_ranks([([*FP32_BERT, *steps, "dataset.batch_size=4"], tmp_path / "ddp")])
    from runner.run import run

    run(make_cfg(*FP32_BERT, *steps, "dataset.batch_size=8"), tmp_path / "one")
    ddp, one = read_metrics(tmp_path / "ddp"), read_metrics(tmp_path / "one")
    assert [r["step"] for r in ddp] == [1, 2, 3, 4]
    for a, b in zip(ddp, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    weights_ddp, weights_one = load_last(tmp_path / "ddp")["model"], load_last(tmp_path / "one")
    for name, tensor in weights_one["model"].items():
        torch.testing.assert_close(weights_ddp[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["batch_size"] == 8
    # rank 0 alone writes: one metrics file, one checkpoint folder, no second summary
    assert sorted(p.name for p in (tmp_path / "ddp").iterdir()) == [
        "checkpoints",
        "metrics.jsonl",
        "rank0.json",
        "rank1.json",
        "summary.json",
    ]


def test_gradients_are_averaged_once_per_accumulation_window(tmp_path):
    common = [*TINY_MLP, "trainer.max_steps=3"]
    reports = run_ranks(
        [
            ([*common, "trainer.accumulate_grad_batches=1"], tmp_path / "k1"),
            ([*common, "trainer.accumulate_grad_batches=4"], tmp_path / "k4"),
        ],
        count_syncs=True,
    )
    per_window = [report[0]["syncs"] for report in reports]
    assert per_window[0] > 0 and per_window[1] == per_window[0]  # 4 micro-batches, one sync


def test_a_resumed_two_rank_run_continues_bit_for_bit(tmp_path):
    """Dropout on (each rank has its own random stream, saved and restored per rank)."""
    common = [*TINY_BERT, "model.dropout=0.1", "trainer.log_every_n_steps=1"]
    run_ranks(
        [
            ([*common, "trainer.max_steps=6"], tmp_path / "straight"),
            ([*common, "trainer.max_steps=3"], tmp_path / "resumed"),
            ([*common, "trainer.max_steps=6", "trainer.resume=auto"], tmp_path / "resumed"),
        ]
    )
    straight, resumed = load_last(tmp_path / "straight"), load_last(tmp_path / "resumed")
    assert resumed["step"] == 6 and len(resumed["rng_by_rank"]) == WORLD
    for name, tensor in straight["model"].items():
        assert torch.equal(resumed["model"][name], tensor), name
    rows_a, rows_b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["loss"] for r in rows_a] == [r["loss"] for r in rows_b]


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    def term_rank_1(procs):
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.monotonic() + PATIENCE_S
        while not (metrics.exists() and metrics.read_text()):  # until training is under way
            if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                for p in procs:
                    p.kill()
                pytest.fail("the ranks never started training")
            time.sleep(0.1)
        os.kill(procs[1].pid, signal.SIGTERM)

    cfg = [*TINY_MLP, "trainer.max_steps=100000", "dataset.num_samples=4096"]
    cfg.append("trainer.log_every_n_steps=1")
    [reports] = run_ranks([(cfg, tmp_path)], on_start=term_rank_1)
    assert [r["outcome"] for r in reports] == ["preempted", "preempted"]
    state = load_last(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "preempted" and 0 < state["step"] == summary["steps"] < 100000


def test_torchrun_runs_two_ranks_into_one_run_directory(tmp_path):
    result = cli(
        *TINY_MLP,
        "trainer.max_steps=5",
        "logger=wandb",
        cwd=tmp_path,
        launcher=("-m", "torch.distributed.run", "--nproc_per_node=2"),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    [run_dir] = [p.parent for p in (tmp_path / "outputs").glob("*/*/summary.json")]
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    assert len(list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))) == 1
    assert len(list((tmp_path / "outputs").glob("*/*"))) == 1  # rank 1 made no directory


def test_a_submitit_job_with_two_tasks_trains_as_two_ranks(tmp_path):
    """Hydra's submitit launcher (local here, SLURM on a cluster): each task of a job is a rank."""
    sweep = tmp_path / "sweep"
    result = cli(
        "-m",
        "hydra/launcher=submitit_local",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.timeout_min=10",
        *TINY_MLP,
        "trainer.max_steps=5",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert len(read_metrics(sweep / "0")) == 5


def test_fsdp_in_one_process_is_one_clear_error(tmp_path):
    from runner.errors import UserError
    from runner.run import run

    with pytest.raises(UserError, match="shards over several processes: start them with torchrun"):
        run(make_cfg(*TINY_MLP, "trainer.strategy=fsdp"), tmp_path)


def test_fsdp_equals_one_process_with_the_global_batch(tmp_path):
    """FSDP2 over 2 ranks, fp32: the same losses, grad norms and weights as one process."""
    steps = ["trainer.max_steps=3", "optim.optimizer.eps=1e-4"]
    run_ranks(
        [([*FP32_BERT, *steps, "dataset.batch_size=4", "trainer.strategy=fsdp"], tmp_path / "fsdp")]
    )
    from runner.run import run

    run(make_cfg(*FP32_BERT, *steps, "dataset.batch_size=8"), tmp_path / "one")
    fsdp, one = read_metrics(tmp_path / "fsdp"), read_metrics(tmp_path / "one")
    for a, b in zip(fsdp, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    # each rank wrote its shard: half of every sharded weight, and together all of it
    folder = tmp_path / "fsdp" / "checkpoints"
    shards = [
        torch.load(folder / name, weights_only=True) for name in ("last.pt", "last.shard1.pt")
    ]
    assert shards[0]["shards"] == 2 and shards[1]["step"] == 3
    expected = load_last(tmp_path / "one")["model"]
    name = "model.bert.encoder.layer.0.intermediate.dense.weight"
    halves = [s["model"][name].to_local() for s in shards]
    assert halves[0].shape[0] == expected[name].shape[0] // 2
    torch.testing.assert_close(torch.cat(halves), expected[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_fsdp_mixed_precision_trains_and_resumes_from_its_shards(tmp_path, mode):
    """bf16/fp16 parameters for compute, fp32 shards and gradient reduction; fp16 with the
    sharded GradScaler. A run resumed from its sharded checkpoint continues bit for bit."""
    common = [*TINY_BERT, *LOG_EACH, "trainer.strategy=fsdp", f"precision={mode}"]
    run_ranks(
        [
            ([*common, "trainer.max_steps=6"], tmp_path / "straight"),
            ([*common, "trainer.max_steps=3"], tmp_path / "resumed"),
            ([*common, "trainer.max_steps=6", "trainer.resume=auto"], tmp_path / "resumed"),
        ]
    )
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [(r["loss"], r["loss_scale"]) for r in a] == [(r["loss"], r["loss_scale"]) for r in b]
    assert a[-1]["loss"] < a[0]["loss"] and not any(r["skipped"] for r in a)
    summary = json.loads((tmp_path / "straight" / "summary.json").read_text())
    assert summary["low_precision_flop_share"] > 0.5  # the matmuls ran in low precision
    if mode == "fp16":
        assert a[0]["loss_scale"] == 65536.0
