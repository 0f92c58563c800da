"""nvfp4's stochastic rounding across a resume (issue 39): each rank's generator is seeded from the
run's seed and its rank, saved in the checkpoint (`streams_by_rank`) and restored, so a resumed
run rounds the gradients as one that never stopped, bit for bit; a checkpoint written before the
generators were saved still resumes, with a warning."""

from __future__ import annotations

import pytest
import torch

from runner.precision import fp4
from runner.precision.fp4 import Recipe
from runner.precision.fp4_quant import NVFP4, quantize
from runner.run import run
from tests.helpers import load_last, make_cfg, read_metrics
from tests.test_distributed import WORLD, run_ranks
from tests.test_fp4 import _gpt

# Every Linear of the tiny GPT but its head in NVFP4, stochastic rounding on (nvfp4's default).
NVFP4_GPT = _gpt(
    "precision=nvfp4",
    "precision.fp4.keep_bf16.last=0",
    "precision.fp4.skip=[last]",
    "optim.optimizer.lr=1e-2",
    "trainer.log_every_n_steps=1",
)


def _losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


def _straight_and_resumed(tmp_path, steps: int, stop: int) -> None:
    """`steps` steps in one go (`straight`), and `stop` steps then resumed to `steps` (`resumed`)."""
    run(make_cfg(*NVFP4_GPT, f"trainer.max_steps={steps}"), tmp_path / "straight")
    run(make_cfg(*NVFP4_GPT, f"trainer.max_steps={stop}"), tmp_path / "resumed")
    resume = [f"trainer.max_steps={steps}", "trainer.resume=auto"]
    run(make_cfg(*NVFP4_GPT, *resume), tmp_path / "resumed")


def test_an_nvfp4_run_resumed_rounds_as_one_that_never_stopped(tmp_path):
    """Interrupted after 3 steps of 6: the same losses and weights, bit for bit (with the
    generator restarted from its seed, step 5's loss differed: 3.560876 against 3.564033)."""
    _straight_and_resumed(tmp_path, steps=6, stop=3)
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")
    straight, resumed = load_last(tmp_path / "straight"), load_last(tmp_path / "resumed")
    for name, tensor in straight["model"].items():
        assert torch.equal(resumed["model"][name], tensor), name
    assert resumed["step"] == 6 and set(resumed["streams_by_rank"][0]["fp4_sr"]) == {"cpu"}


def test_a_checkpoint_without_the_generator_state_resumes_with_a_warning(tmp_path, capsys):
    """A checkpoint written before issue 39's fix (no `streams_by_rank`): the run resumes, its
    stochastic rounding restarting from the seed, and says so."""
    run(make_cfg(*NVFP4_GPT, "trainer.max_steps=2"), tmp_path)
    path = tmp_path / "checkpoints" / "last.pt"
    old = torch.load(path, weights_only=True)
    old.pop("streams_by_rank", None)
    torch.save(old, path)
    capsys.readouterr()
    run(make_cfg(*NVFP4_GPT, "trainer.max_steps=4", "trainer.resume=auto"), tmp_path)
    err = " ".join(capsys.readouterr().err.split())
    assert "holds no stochastic rounding state" in err and "restarts from its seed" in err
    assert load_last(tmp_path)["step"] == 4 and len(read_metrics(tmp_path)) == 4


def _draws(recipe: Recipe, x: torch.Tensor) -> torch.Tensor:
    return quantize(x, NVFP4, stochastic=True, generator=recipe.generator(x.device)).dequantize()


def test_each_rank_rounds_with_its_own_stream_and_a_restored_one_continues():
    """One seed: rank 0 and rank 1 round the same gradient differently, a rank the same way
    twice; a generator loaded from another's `sr_state` draws what the other draws next."""
    x = torch.randn(64, 64)
    ranks = [_draws(Recipe(NVFP4, seed=7, rank=r), x) for r in (0, 1, 0)]
    assert not torch.equal(ranks[0], ranks[1]) and torch.equal(ranks[0], ranks[2])
    # a run's ranks are seeded seed + rank (runner/run.py): their generators' 32 bits all differ
    assert len({fp4.sr_seed(7 + rank, rank) % 2**32 for rank in range(256)}) == 256

    going, restored = Recipe(NVFP4, seed=7), Recipe(NVFP4, seed=7)
    _draws(going, x)
    restored.load_sr_state(going.sr_state())
    assert torch.equal(_draws(restored, x), _draws(going, x))
    assert restored.sr_state()["cpu"].equal(going.sr_state()["cpu"])


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
def test_a_resumed_two_rank_nvfp4_run_continues_bit_for_bit_each_rank_with_its_stream(tmp_path):
    """DDP over gloo: every rank's generator state is saved (`streams_by_rank`, one per rank,
    different), and the run resumed after 2 steps of 4 logs the same losses."""
    common = [*NVFP4_GPT, "dataset.batch_size=8"]
    run_ranks(
        [
            ([*common, "trainer.max_steps=4"], tmp_path / "straight"),
            ([*common, "trainer.max_steps=2"], tmp_path / "resumed"),
            ([*common, "trainer.max_steps=4", "trainer.resume=auto"], tmp_path / "resumed"),
        ]
    )
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")
    state = load_last(tmp_path / "resumed")
    streams = [rank["fp4_sr"]["cpu"] for rank in state["streams_by_rank"]]
    assert state["step"] == 4 and len(streams) == WORLD and not torch.equal(*streams)
