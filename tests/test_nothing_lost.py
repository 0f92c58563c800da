"""Nothing lost, nothing silently demoted: an evaluation that fails keeps the run's record, a
checkpoint from another precision mode is refused or converted with the fp32 masters, a non-finite
buffer is never checkpointed and the forensic replay leaves buffers alone, and a finished run
resumed on two ranks ends at once with its summary."""

from __future__ import annotations

import hashlib
import json
import time

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from runner.errors import TrainingStopped, UserError
from runner.run import run
from tests.helpers import TINY_MLP, load_last, make_cfg, read_metrics

HERE = "tests.test_nothing_lost"
QUIET = ["trainer.progress_bar=false", "logger=none"]


# -- a user's own net and data, by _target_ ----------------------------------------------------


class NormNet(nn.Module):
    """Linear → BatchNorm → GELU → Linear: running statistics updated by each train forward."""

    def __init__(self, outputs: int = 3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU())
        self.head = nn.Linear(16, outputs)

    def forward(self, x):
        return self.head(self.net(x))


def pairs(n: int = 64, seed: int = 0, regression: bool = False, nan_in: str | None = None):
    """(x, y) with 8 features and 3 classes (or 3 regression targets); `nan_in` = "input" or
    "target": one sample carries NaN there, so the one step that holds it is non-finite."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    if regression:
        y = y.float().unsqueeze(1).expand(n, 3).clone()
    if nan_in == "input":
        x[n // 2] = float("nan")
    elif nan_in == "target":
        y[n // 2] = float("nan")
    return TensorDataset(x, y)


def with_an_unseen_class(n: int = 128) -> Dataset:
    """A validation split whose last items hold a class the training split lacks (7, for a net
    with 3 outputs): the first items are fine, the evaluation's last batches are not."""
    x, y = pairs(n, seed=1).tensors
    y = y.clone()
    y[n - 16 :] = 7
    return TensorDataset(x, y)


class Interrupted(Dataset):
    """A validation split whose first item is never read: Ctrl-C arrives during evaluation."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index):
        if index == 0:
            return torch.zeros(8), torch.tensor(0)  # the dataset's own check of one item
        raise KeyboardInterrupt


def module_cfg(*overrides: str, net: str = "NormNet", data: str = "pairs"):
    return make_cfg(
        "model=module",
        f"model.net._target_={HERE}.{net}",
        f"dataset.train._target_={HERE}.{data}",
        "dataset.batch_size=16",
        *QUIET,
        *overrides,
    )


# -- 3. evaluation never costs the run its record ----------------------------------------------


def test_limit_val_batches_0_means_no_evaluation(tmp_path):
    summary = run(
        make_cfg(*TINY_MLP, "trainer.max_steps=4", "trainer.limit_val_batches=0"), tmp_path
    )
    rows = read_metrics(tmp_path)
    assert summary["status"] == "completed" and "eval_error" not in summary
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert not any(key.startswith("eval_") for row in rows for key in row)
    assert load_last(tmp_path)["step"] == 4


def test_an_evaluation_that_fails_keeps_the_rows_and_the_checkpoint(tmp_path, capsys):
    """Evaluation at step 3 meets a class the net cannot predict: one warning line, training
    goes on to the end (without evaluating again), and the summary names the failed step."""
    cfg = module_cfg(
        f"dataset.validation._target_={HERE}.with_an_unseen_class",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "trainer.log_every_n_steps=1",
    )
    summary = run(cfg, tmp_path)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert not any("eval_loss" in r for r in rows)
    assert load_last(tmp_path)["step"] == 6
    assert summary["status"] == "completed"
    assert summary["eval_error"]["step"] == 3 and "out of bounds" in summary["eval_error"]["error"]
    assert json.loads((tmp_path / "summary.json").read_text())["eval_error"]["step"] == 3
    err = capsys.readouterr().err
    assert err.count("evaluation at step 3 failed") == 1 and "Traceback" not in err


def test_the_interval_is_written_before_its_evaluation(tmp_path):
    """Interrupted while evaluating at step 3: steps 1-3 are in metrics.jsonl already."""
    cfg = module_cfg(
        f"dataset.validation._target_={HERE}.Interrupted",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
    )
    with pytest.raises(KeyboardInterrupt):
        run(cfg, tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "interrupted"


def test_an_evaluated_row_is_written_once_with_its_metrics(tmp_path):
    cfg = module_cfg(
        f"dataset.validation._target_={HERE}.pairs",
        "+dataset.validation.seed=1",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
    )
    summary = run(cfg, tmp_path)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [("eval_loss" in r) for r in rows] == [False, True, False, True]
    assert summary["eval_loss"] == rows[-1]["eval_loss"]


# -- 5. resume never drops state silently ------------------------------------------------------

MLP_STEPS = [*TINY_MLP, "trainer.log_every_n_steps=1", "model.hidden_size=16"]


@pytest.fixture
def fp16_master_run(tmp_path):
    run(make_cfg(*MLP_STEPS, "precision=fp16_master", "trainer.max_steps=2"), tmp_path / "a")
    return tmp_path / "a"


def test_a_checkpoint_from_another_mode_is_refused_naming_both(fp16_master_run):
    cfg = make_cfg(*MLP_STEPS, "precision=bf16", "trainer.max_steps=3", "trainer.resume=auto")
    with pytest.raises(UserError) as err:
        run(cfg, fp16_master_run)
    message = str(err.value)
    assert "precision.mode=bf16 (it ran: fp16_master)" in message
    assert "trainer.resume_across_precision=true" in message and "\n" not in message
    assert load_last(fp16_master_run)["step"] == 2  # nothing trained, nothing written


def test_resume_across_precision_continues_from_the_fp32_masters(fp16_master_run, tmp_path):
    """fp16_master → bf16: the resumed run trains from the fp32 masters. The reference resumes,
    in bf16 with no conversion, a copy of the checkpoint whose weights are those masters: the two
    end with the same weights, bit for bit (from the fp16 copies they would differ)."""
    saved = load_last(fp16_master_run)
    names = list(saved["model"])  # the MLP's state is its parameters, in order
    assert len(names) == len(saved["master_weights"])
    assert all(saved["model"][n].dtype == torch.float16 for n in names)

    reference = tmp_path / "reference"  # a run of its own, from the hand-made checkpoint
    by_hand = saved | {
        "model": dict(zip(names, saved["master_weights"], strict=True)),
        "master_weights": [],
        "scaler": None,
        "precision": "bf16",
    }
    torch.save(by_hand, tmp_path / "by_hand.pt")
    resume = ["precision=bf16", "trainer.max_steps=3", "trainer.resume=auto"]
    run(make_cfg(*MLP_STEPS, *resume[:2], f"trainer.resume={tmp_path / 'by_hand.pt'}"), reference)

    summary = run(
        make_cfg(*MLP_STEPS, *resume, "trainer.resume_across_precision=true"), fp16_master_run
    )
    converted, expected = load_last(fp16_master_run), load_last(reference)
    assert converted["step"] == 3 and converted["precision"] == "bf16"
    for name in names:
        assert converted["model"][name].dtype == torch.float32
        assert torch.equal(converted["model"][name], expected["model"][name]), name
    report = summary["resumed_across_precision"]
    assert report["from"] == "fp16_master" and report["to"] == "bf16"
    assert any("GradScaler" in change and "dropped" in change for change in report["changes"])


# -- 6. buffers are part of the state ----------------------------------------------------------


def test_a_non_finite_batchnorm_statistic_is_never_checkpointed(tmp_path):
    """A NaN input: its step is skipped (the weights stay finite), but its forward put NaN into
    BatchNorm's running statistics, which must not be saved."""
    cfg = module_cfg("+dataset.train.nan_in=input", "trainer.max_steps=4")
    with pytest.raises(
        TrainingStopped, match=r"non-finite state at step 4: net\.net\.1\.running_mean"
    ):
        run(cfg, tmp_path)
    assert not (tmp_path / "checkpoints" / "last.pt").exists()


def test_the_forensic_replay_leaves_batchnorm_statistics_alone(tmp_path):
    """A NaN target: the step is skipped and replayed; its forward is finite. Each of the 4 steps
    ran one train-mode forward, so BatchNorm counted 4 batches: the replay's is not counted."""
    cfg = module_cfg(
        "+dataset.train.regression=true",
        "+dataset.train.nan_in=target",
        "model.loss=mse",
        "trainer.max_steps=4",
    )
    summary = run(cfg, tmp_path)
    assert summary["skipped_steps"] == 1 and (tmp_path / "nonfinite.json").exists()
    state = load_last(tmp_path)["model"]
    assert int(state["net.net.1.num_batches_tracked"]) == 4
    assert torch.isfinite(state["net.net.1.running_var"]).all()


# -- 9. a finished run resumed on several ranks ------------------------------------------------


def _digests(folder) -> dict[str, str]:
    names = ("summary.json", "metrics.jsonl", "checkpoints/last.pt")
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in names}


@pytest.mark.slow  # over 20 s on 2 cores: make test stays under 10 minutes
def test_a_finished_run_resumed_on_two_ranks_ends_at_once_with_its_summary(tmp_path):
    from tests.test_distributed import run_ranks

    steps = [*TINY_MLP, "trainer.max_steps=3"]
    run_ranks([(steps, tmp_path)])
    before = _digests(tmp_path)
    # A requeued job: both ranks end at once (exit 0), and nothing of the record is rewritten.
    reports = run_ranks([([*steps, "trainer.resume=auto"], tmp_path)])
    assert [r["outcome"] for r in reports[0]] == ["completed", "completed"]
    assert _digests(tmp_path) == before
    # Killed before its summary.json: the summary is rebuilt, rank 1 having no rows of its own.
    (tmp_path / "summary.json").unlink()
    run_ranks([([*steps, "trainer.resume=auto"], tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert summary["final_loss"] == read_metrics(tmp_path)[-1]["loss"]


def test_every_step_reaches_wandb_once_across_resumes(tmp_path):
    """A resumed run sends W&B the rows its earlier attempt's W&B never got (its service died
    with the trainer: steps 4-5 here) and not the ones it holds already (a run killed after its
    last checkpoint sent steps 7-8, which the next attempt trains again): the attempts' offline
    files hold steps 1..9, each once, as `wandb sync` uploads them."""
    from runner import wandb_file
    from runner.tracking import RunLog, WandbTracker

    cfg = make_cfg(*TINY_MLP, "logger=wandb")

    def rows(*steps):
        return [{"step": s, "loss": 1.0 / s, "step_time_s": 0.1} for s in steps]

    def attempt(run_id, resume_step, steps, metrics_only=()):
        tracker = WandbTracker(cfg, tmp_path, run_id)
        log = RunLog(tmp_path, tracker, resume_step=resume_step)
        log.log_rows(rows(*steps))
        log.finish({"status": "stopped"}, 1)
        with open(tmp_path / "metrics.jsonl", "a") as f:  # written; W&B's service had died
            f.writelines(json.dumps(r) + "\n" for r in rows(*metrics_only))
        # W&B's service may still be writing the file as finish() returns (its process is gone
        # before a real next attempt starts)
        for _ in range(300):
            if wandb_file.last_step(tmp_path, tracker.run_id) == steps[-1]:
                break
            time.sleep(0.1)
        return tracker.run_id

    run_id = attempt(None, None, [1, 2, 3], metrics_only=[4, 5])
    attempt(run_id, 5, [6, 7, 8])  # killed after its checkpoint at step 6
    attempt(run_id, 6, [7, 8, 9])
    files = wandb_file.run_files(tmp_path, run_id)
    assert len(files) == 3
    sent = [row["step"] for path in files for row in wandb_file.history(path)]
    assert sent == list(range(1, 10))
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 10))
