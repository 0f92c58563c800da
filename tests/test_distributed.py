"""DDP on the CPU: real processes joined by gloo, each calling `run` as torchrun's workers do."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Callable
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


Spy = Callable[[int], Callable[[], dict]]  # installed in a rank: figures of the job since


def _rank(rank: int, port: int, jobs: list[tuple[list[str], str]], spy: Spy | None) -> None:
    """One rank: runs each (overrides, run dir) job in turn, as `torchrun -m runner` would. Its
    report: the outcome, what the console said (rank 0 alone speaks) and the spy's figures."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        COLUMNS="1000",  # the console's width: a message is one line in the report
    )
    torch.set_num_threads(1)
    from runner.errors import Preempted
    from runner.run import run
    from runner.train import distributed

    figures = spy(rank) if spy else dict
    try:
        for overrides, out in jobs:
            figures()  # from this job on
            console, stopped_at = io.StringIO(), None
            try:
                with contextlib.redirect_stderr(console):
                    run(make_cfg(*overrides), out)
                outcome = "completed"
            except Preempted as e:
                outcome, stopped_at = "preempted", e.step
            report = {"outcome": outcome, "stopped_at": stopped_at, "console": console.getvalue()}
            report |= figures()
            Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        distributed.close(distributed.from_env())


def count_ddp_syncs(rank: int) -> Callable[[], dict]:
    """A spy on DDP's gradient all-reduce (it still runs): how many buckets it sent."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    syncs = []
    ddp = torch.nn.parallel.DistributedDataParallel
    init = ddp.__init__

    def counting_hook(state, bucket):
        syncs.append(1)
        return allreduce_hook(state, bucket)

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.register_comm_hook(None, counting_hook)

    ddp.__init__ = counting_init

    def figures() -> dict:
        count = len(syncs)
        syncs.clear()
        return {"syncs": count}

    return figures


def run_ranks(
    jobs: list[tuple[list[str], Path]],
    spy: Spy | None = None,
    on_start: Callable[[list], None] | None = None,
    killed: bool = False,
) -> list:
    """Starts WORLD ranks on `jobs`, waits for them; returns each job's per-rank reports.
    `on_start(procs)` runs once they are started; `killed`: it kills them, so no reports."""
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    jobs = [(list(o), str(d)) for o, d in jobs]
    procs = [context.Process(target=_rank, args=(r, port, jobs, spy)) for r in range(WORLD)]
    for p in procs:
        p.start()
    if on_start:
        on_start(procs)
    for p in procs:
        p.join(timeout=PATIENCE_S)
        if p.exitcode is None:
            for q in procs:
                q.kill()
        assert killed or p.exitcode == 0, f"rank exited with {p.exitcode}"
    if killed:
        return []
    return [
        [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(WORLD)] for _, d in jobs
    ]


def _wait_for(path: Path, procs: list) -> None:
    """Until `path` exists; a rank that dies first fails the test."""
    deadline = time.monotonic() + PATIENCE_S
    while not path.exists():
        if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
            for p in procs:
                p.kill()
            pytest.fail(f"the ranks never made {path.name}")
        time.sleep(0.1)


LOG_EACH = ["trainer.log_every_n_steps=1"]
FP32_BERT = [*TINY_BERT, "precision=fp32", *LOG_EACH]


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
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
        ".lock",
        "checkpoints",
        "metrics.jsonl",
        "rank0.json",
        "rank1.json",
        "run.json",
        "summary.json",
    ]


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
def test_gradients_are_averaged_once_per_accumulation_window(tmp_path):
    common = [*TINY_MLP, "trainer.max_steps=3"]
    reports = run_ranks(
        [
            ([*common, "trainer.accumulate_grad_batches=1"], tmp_path / "k1"),
            ([*common, "trainer.accumulate_grad_batches=4"], tmp_path / "k4"),
        ],
        spy=count_ddp_syncs,
    )
    per_window = [report[0]["syncs"] for report in reports]
    assert per_window[0] > 0 and per_window[1] == per_window[0]  # 4 micro-batches, one sync


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
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


SIGNALLED_IN_STEP = 13  # past the warm-up's flush (step 10), far from the next (step 50)


def sigterm_rank_1(rank: int) -> Callable[[], dict]:
    """Rank 1 sends itself SIGTERM as it starts step SIGNALLED_IN_STEP."""
    if rank == 1:
        from runner.train.trainer import Trainer

        train_step = Trainer.train_step

        def signalled(self, window):
            if self.step + 1 == SIGNALLED_IN_STEP:
                os.kill(os.getpid(), signal.SIGTERM)
            return train_step(self, window)

        Trainer.train_step = signalled
    return dict


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
def test_a_signal_to_one_rank_stops_every_rank_within_one_step(tmp_path):
    """Between flush points too (log_every_n_steps=50): the flag travels with each step's token
    count, so rank 0 learns of it at once and both stop at the step after the signal's."""
    cfg = [*TINY_MLP, "trainer.max_steps=200", "trainer.log_every_n_steps=50"]
    [reports] = run_ranks([(cfg, tmp_path)], spy=sigterm_rank_1)
    assert [r["outcome"] for r in reports] == ["preempted", "preempted"]
    stopped = {r["stopped_at"] for r in reports}
    assert stopped == {SIGNALLED_IN_STEP + 1}, stopped
    state = load_last(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "preempted" and state["step"] == summary["steps"] == min(stopped)


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
def test_torchrun_runs_two_ranks_into_one_run_directory(tmp_path):
    ranks = tmp_path / "ranks"  # each rank's own output, where a failure says why
    result = cli(
        *TINY_MLP,
        "trainer.max_steps=5",
        "logger=wandb",
        cwd=tmp_path,
        launcher=(
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--log-dir={ranks}",
            "--tee=3",
        ),
    )
    assert result.returncode == 0, rank_outputs(ranks) + result.stderr[-2000:]
    [run_dir] = [p.parent for p in (tmp_path / "outputs").glob("*/*/summary.json")]
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    assert len(list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))) == 1
    assert len(list((tmp_path / "outputs").glob("*/*"))) == 1  # rank 1 made no directory


def rank_outputs(log_dir: Path) -> str:
    """The end of each rank's stderr (torchrun --log-dir): the rank that failed first says why,
    where torchrun's own summary, last on its stderr, does not."""
    return "".join(
        f"--- {path.relative_to(log_dir)}:\n{path.read_text()[-3000:]}\n"
        for path in sorted(log_dir.rglob("stderr.log"))
    )


@pytest.mark.slow  # over 20 s on 2 cores: make test stays under 10 minutes
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


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
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
    # Each matmul's measured error (on by default) under FSDP too: every module and direction
    # one process measures, fp32's none lost.
    errors = [
        json.loads((tmp_path / d / "summary.json").read_text())["matmul_error"]
        for d in ("fsdp", "one")
    ]
    pairs = [{(r["module"], r["direction"]) for r in e} for e in errors]
    assert pairs[0] == pairs[1] and len(pairs[0]) > 6
    assert all(float(r["sqnr_db"]) == float("inf") for r in errors[0])  # JSON's "inf"
    # A DCP set: each rank wrote its file, half of every sharded weight, together all of it.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from runner.train.sharded import read_metadata

    folder = tmp_path / "fsdp" / "checkpoints" / "last-3"
    assert torch.load(folder / "state.pt", weights_only=True)["shards"] == 2
    name = "model.bert.encoder.layer.0.intermediate.dense.weight"
    expected = load_last(tmp_path / "one")["model"][name]
    metadata = read_metadata(folder)
    chunks = metadata.state_dict_metadata[f"model.{name}"].chunks
    assert [c.sizes[0] for c in chunks] == [expected.shape[0] // 2] * 2
    files = {info.relative_path for i, info in metadata.storage_data.items() if name in i.fqn}
    assert len(files) == 2
    dcp_to_torch_save(folder, tmp_path / "whole.pt")  # PyTorch's own tool reads the set
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)["model"][name]
    torch.testing.assert_close(whole, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
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


def stall_before_committing_step_4(rank: int) -> Callable[[], dict]:
    """Once every rank has written its shards of step-4, rank 0 (DCP's coordinator, the one that
    commits a set) stalls before writing the set's metadata, until the test kills the ranks."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    finish = FileSystemWriter.finish

    def stalled(self, metadata, results):
        folder = Path(self.path)
        if folder.name == "step-4":
            (folder.parent.parent / "stalled").touch()
            time.sleep(PATIENCE_S)
        return finish(self, metadata, results)

    FileSystemWriter.finish = stalled
    return dict


FSDP_MLP = [*TINY_MLP, *LOG_EACH, "trainer.strategy=fsdp", "trainer.val_check_interval=0"]


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
def test_a_run_killed_between_the_ranks_writes_resumes_from_the_previous_whole_set(tmp_path):
    """Killed after the ranks wrote their shards of step-4 and before the set was committed:
    resume=auto skips step-4, naming it, and continues from step-2 bit for bit."""
    run_dir, common = tmp_path / "run", [*FSDP_MLP, "trainer.checkpoint_every_n_steps=2"]
    job = [*common, "trainer.max_steps=6"]

    def kill_once_stalled(procs):
        _wait_for(run_dir / "stalled", procs)
        for p in procs:
            p.kill()

    run_ranks(
        [(job, run_dir)],
        spy=stall_before_committing_step_4,
        on_start=kill_once_stalled,
        killed=True,
    )
    folder = run_dir / "checkpoints"
    assert {p.name for p in (folder / "step-4").iterdir()} == {
        "state.pt",
        "__0_0.distcp",
        "__1_0.distcp",
    }  # every rank's shards, no commit
    [resumed, _] = run_ranks(
        [([*job, "trainer.resume=auto"], run_dir), (job, tmp_path / "straight")]
    )
    said = resumed[0]["console"]
    assert f"skipping step-4: checkpoint {folder / 'step-4'} is incomplete" in said
    assert f"resumed from {folder / 'step-2'} at step 2" in said
    a, b = read_metrics(run_dir), read_metrics(tmp_path / "straight")
    assert [r["step"] for r in a] == list(range(1, 7))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4", "step-6"]
    assert all((folder / name / ".metadata").exists() for name in ("step-4", "step-6"))


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
def test_a_sharded_checkpoint_resumes_on_another_number_of_ranks(tmp_path):
    """2 FSDP ranks → 1 process (DCP reshards the set on load) and 1 process → 2 FSDP ranks (each
    keeps its part of the single file): the same losses as one uninterrupted process with the
    global batch, the first rows kept as the first run wrote them."""
    from runner.run import run

    one = [*TINY_MLP, *LOG_EACH, "trainer.val_check_interval=0", "dataset.batch_size=8"]
    two = [*FSDP_MLP, "dataset.batch_size=4"]
    run(make_cfg(*one, "trainer.max_steps=3"), tmp_path / "one_to_two")
    first_rows = {"one_to_two": read_metrics(tmp_path / "one_to_two")}
    [_, grown] = run_ranks(
        [
            ([*two, "trainer.max_steps=3"], tmp_path / "two_to_one"),
            ([*two, "trainer.max_steps=6", "trainer.resume=auto"], tmp_path / "one_to_two"),
        ]
    )
    first_rows["two_to_one"] = read_metrics(tmp_path / "two_to_one")
    run(make_cfg(*one, "trainer.max_steps=6", "trainer.resume=auto"), tmp_path / "two_to_one")
    run(make_cfg(*one, "trainer.max_steps=6"), tmp_path / "straight")
    assert "one_to_two/checkpoints/last.pt at step 3" in grown[0]["console"]
    straight = read_metrics(tmp_path / "straight")
    for name, rows in first_rows.items():
        resumed = read_metrics(tmp_path / name)
        assert resumed[:3] == rows  # written before the checkpoint it resumed from
        for a, b in zip(resumed, straight, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), name
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), name
    weights = load_last(tmp_path / "two_to_one")["model"]  # one process: a single file again
    for key, tensor in load_last(tmp_path / "straight")["model"].items():
        torch.testing.assert_close(weights[key], tensor, rtol=1e-4, atol=1e-6, msg=key)
