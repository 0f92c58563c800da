"""nonfinite.json describes the step that failed: replayed on that step's own weights, with the
failing rank's own micro-batches, naming the first module whose output, or whose gradient in
backward order, became non-finite."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from runner.errors import TrainingStopped
from runner.run import run
from runner.train import diagnostics
from tasks.classification import Blobs
from tests.helpers import TINY_MLP, load_last, make_cfg, read_metrics

POISONED_STEP = 3


class PoisonedBlobs(Blobs):
    """Blobs whose `offset`-th sample of the global batch of `step` (`POISONED_STEP`; and of
    `later`, where given) is NaN: that step's loss is non-finite whatever the weights, and the
    steps around it are healthy."""

    def __init__(
        self,
        *args,
        global_batch: int,
        offset: int = 0,
        step: int = POISONED_STEP,
        later: int | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        order = np.random.default_rng([self.seed, 0]).permutation(self.split_size("train"))
        steps = [step] + ([later] if later else [])
        self.poisoned = {int(order[(s - 1) * global_batch + offset]) for s in steps}

    def collate(self, split, keys):
        batch = super().collate(split, keys)
        for row, key in enumerate(keys):
            if split == "train" and key[2] in self.poisoned:
                batch["features"][row] = float("nan")
        return batch


def _poisoned(batch: int, global_batch: int, offset: int = 0) -> list[str]:
    return [
        *TINY_MLP,
        "dataset._target_=tests.test_forensics.PoisonedBlobs",
        f"+dataset.global_batch={global_batch}",
        f"+dataset.offset={offset}",
        f"dataset.batch_size={batch}",
        # No flush between steps: the trainer learns of the skip once the next step is queued.
        "trainer.log_every_n_steps=50",
        "trainer.val_check_interval=0",
    ]


def test_the_replay_runs_on_the_weights_of_the_step_that_failed(tmp_path, monkeypatch):
    seen = {}
    replay = diagnostics.replay

    def spy(task, *args):
        seen["weights"] = {k: v.clone() for k, v in task.state_dict().items()}
        return replay(task, *args)

    monkeypatch.setattr(diagnostics, "replay", spy)
    overrides = _poisoned(batch=8, global_batch=8)
    summary = run(make_cfg(*overrides, "trainer.max_steps=5"), tmp_path / "run")
    assert summary["skipped_steps"] == 1
    rows = read_metrics(tmp_path / "run")
    report = json.loads((tmp_path / "run" / "nonfinite.json").read_text())
    assert report["step"] == next(r["step"] for r in rows if r["skipped"]) == POISONED_STEP
    assert report["forward"]["first_nonfinite"] == "net.0"  # the NaN sample enters there
    # The weights the failed step saw are those after the step before it: the next step, which
    # was already applied when the trainer learnt of the skip, must not have touched them.
    monkeypatch.setattr(diagnostics, "replay", replay)
    run(make_cfg(*overrides, f"trainer.max_steps={POISONED_STEP - 1}"), tmp_path / "before")
    before = load_last(tmp_path / "before")["model"]
    for name, tensor in before.items():
        assert torch.equal(seen["weights"][name], tensor), name


def test_a_resumed_run_keeps_the_report_of_its_first_non_finite_step(tmp_path):
    """Poisoned at steps 3 and 6, checkpointed at 4; resumed: nonfinite.json still describes
    step 3 (the run's first), and step 6 is skipped without replacing it."""
    overrides = [*_poisoned(batch=8, global_batch=8), "+dataset.later=6"]
    run(make_cfg(*overrides, "trainer.max_steps=4"), tmp_path)
    first = (tmp_path / "nonfinite.json").read_text()
    assert json.loads(first)["step"] == POISONED_STEP
    resumed = [*overrides, "trainer.max_steps=7", "trainer.resume=auto"]
    summary = run(make_cfg(*resumed), tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path) if r["skipped"]] == [POISONED_STEP, 6]
    assert summary["skipped_steps"] == 2
    assert (tmp_path / "nonfinite.json").read_text() == first


def test_a_gradient_overflow_names_the_first_module_in_backward_order(tmp_path):
    """fp16 at an absurd loss scale: the forward is finite, and the gradient overflows fp16 as
    soon as it enters the network: at the output of the last layer."""
    cfg = make_cfg(
        *TINY_MLP,
        "precision=fp16",
        "precision.grad_scaler.init_scale=1e30",
        "trainer.max_steps=4",
        "trainer.max_consecutive_nonfinite=2",
    )
    with pytest.raises(TrainingStopped):
        run(cfg, tmp_path)
    report = json.loads((tmp_path / "nonfinite.json").read_text())
    assert report["step"] == 1 and report["forward"]["first_nonfinite"] is None
    assert report["backward"]["first_nonfinite"] == "net.6"  # the classifier, last Linear
    assert "net.6" in report["hint"]


def test_fp16_master_gets_its_own_hint(tmp_path):
    cfg = make_cfg(
        *TINY_MLP,
        "precision=fp16_master",
        "precision.grad_scaler.init_scale=1e30",
        "trainer.max_steps=4",
        "trainer.max_consecutive_nonfinite=2",
    )
    with pytest.raises(TrainingStopped, match="fp16 weights and activations overflowed"):
        run(cfg, tmp_path)


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
def test_under_ddp_the_failing_rank_replays_its_own_batches(tmp_path):
    """The NaN sample goes to rank 1 (the second half of the global batch): rank 0's
    micro-batches are healthy, so only rank 1's replay can name the module."""
    from tests.test_distributed import run_ranks

    overrides = [*_poisoned(batch=4, global_batch=8, offset=5), "trainer.max_steps=4"]
    run_ranks([(overrides, tmp_path)])
    report = json.loads((tmp_path / "nonfinite.json").read_text())
    assert report["step"] == POISONED_STEP and report["rank"] == 1
    assert report["forward"]["first_nonfinite"] == "net.0"
