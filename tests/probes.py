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
    """Data that takes 20 ms a batch to load: an input-bound run."""

    def collate(self, split, keys):
        time.sleep(0.02)
        return super().collate(split, keys)
