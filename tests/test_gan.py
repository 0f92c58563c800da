"""Two optimizers, one GradScaler: the articles' sequence, and both halves skip together."""

from __future__ import annotations

import pytest
import torch

from runner.run import build, run, seed_everything
from tests.helpers import load_last, make_cfg, read_metrics
from tests.test_precision import _Spy, expected_step
from tests.test_tasks import TINY

GAN = [*TINY["gan"], "logger=none", "trainer.progress_bar=false"]


@pytest.mark.parametrize("fused", [True, False])
def test_scaler_sequence_is_scale_each_unscale_each_step_each_update_once(
    tmp_path, monkeypatch, fused
):
    spy = _Spy(monkeypatch)
    run(
        make_cfg(
            *GAN,
            "precision=fp16",
            "trainer.max_steps=2",
            "trainer.accumulate_grad_batches=2",
            f"optim.optimizer.fused={fused}",
        ),
        tmp_path,
    )
    assert spy.calls == expected_step(4, 2, fused) * 2
    state = load_last(tmp_path)
    assert set(state["optimizer"]) == {"discriminator", "generator"}
    assert state["optimizer"]["generator"]["param_groups"][0]["betas"] == (0.5, 0.999)


@pytest.mark.parametrize(("mode", "fused"), [("fp16", True), ("fp32", True), ("fp16", False)])
def test_both_halves_skip_when_either_has_non_finite_gradients(tmp_path, mode, fused):
    cfg = make_cfg(
        *GAN,
        f"precision={mode}",
        f"optim.optimizer.fused={fused}",
        "model._target_=tests.probes.PoisonedGAN",
        "trainer.max_steps=3",
        "trainer.max_consecutive_nonfinite=10",
    )
    summary = run(cfg, tmp_path)
    assert summary["skipped_steps"] == 3
    assert [r["skipped"] for r in read_metrics(tmp_path)] == [True] * 3
    seed_everything(cfg.seed)
    _, initial = build(cfg)
    saved = load_last(tmp_path)["model"]
    for name, tensor in initial.state_dict().items():
        if (
            name.startswith("discriminator.")
            and "running" not in name
            and "num_batches" not in name
        ):
            assert torch.equal(saved[name], tensor), (
                name
            )  # its gradients were fine: it still skipped


def test_the_generator_loss_leaves_no_gradient_in_the_discriminator():
    data, gan = build(make_cfg(*GAN))
    losses = gan(next(iter(data.train_loader())))
    losses["generator"].backward()
    assert all(p.grad is None for p in gan.discriminator.parameters())
    assert all(p.grad is not None for p in gan.generator.parameters())
    assert all(p.requires_grad for p in gan.discriminator.parameters())


def test_both_losses_are_logged(tmp_path):
    run(make_cfg(*GAN, "precision=bf16", "trainer.max_steps=3"), tmp_path)
    row = read_metrics(tmp_path)[-1]
    assert row["loss"] == pytest.approx(row["loss_discriminator"] + row["loss_generator"])
