"""Tasks that record what the engine does to them: autocast state, dtypes, inference mode."""

from __future__ import annotations

import time

import torch

from tasks.classification import Blobs, MLPClassifier
from tasks.gan import GAN

EVENTS: list[tuple] = []


def _state(x: torch.Tensor) -> dict:
    return {
        "autocast": torch.is_autocast_enabled(x.device.type),
        "inference": torch.is_inference_mode_enabled(),
        "input_dtype": x.dtype,
    }


class ProbeMLP(MLPClassifier):
    def forward(self, batch):
        x = batch["features"]
        EVENTS.append(("forward", _state(x) | {"weight_dtype": self.net[0].weight.dtype}))
        logits = self.net(x)
        logits.register_hook(lambda g: EVENTS.append(("backward", _state(g))))
        return torch.nn.functional.cross_entropy(logits, batch["label"], reduction="sum")

    def eval_sums(self, batch):
        EVENTS.append(("eval", _state(batch["features"])))
        return super().eval_sums(batch)


class PoisonedGAN(GAN):
    """The generator's gradients turn to inf: only the generator is broken, not the discriminator."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generator[0].weight.register_hook(lambda grad: grad * float("inf"))


class SlowBlobs(Blobs):
    """An input-bound run, on any machine and under any load: a training batch takes 20 ms to
    load, or four times as long as the step before it took, whichever is longer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._handed_over: float | None = None  # when the last training batch left

    def collate(self, split, keys):
        if split != "train":
            return super().collate(split, keys)
        step = 0.0 if self._handed_over is None else time.perf_counter() - self._handed_over
        time.sleep(max(0.02, 4 * step))
        batch = super().collate(split, keys)
        self._handed_over = time.perf_counter()
        return batch


def stalled_cli() -> None:
    """`python -c "from tests.probes import stalled_cli; stalled_cli()" STEP MARKER ARGS...`:
    `python -m runner ARGS` whose training stops for good before optimizer step STEP, once it has
    written MARKER. A run that is still under way when a test kills it, however fast the machine."""
    import runpy
    import sys
    from pathlib import Path

    from runner.train.trainer import Trainer

    step, marker = int(sys.argv[1]), Path(sys.argv[2])
    sys.argv = [sys.argv[0], *sys.argv[3:]]
    train_step = Trainer.train_step

    def stalling(self, window):
        if self.step + 1 == step:
            marker.touch()
            while True:  # until killed
                time.sleep(1)
        return train_step(self, window)

    Trainer.train_step = stalling
    runpy.run_module("runner", run_name="__main__", alter_sys=True)
