"""A DCGAN-style generator and discriminator: two optimizers, one GradScaler.

Each step, as the articles prescribe: scale each loss and backpropagate it, `unscale_` each
optimizer, clip, step each, `update()` the scaler once. If either half has non-finite gradients,
both skip (the engine steps all optimizers or none)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import UserError
from runner.task import VALUES, Batch, DataModule, Task, require_kind


@contextlib.contextmanager
def frozen(module: nn.Module):
    """The generator's loss must not leave gradients in the discriminator."""
    flags = [p.requires_grad for p in module.parameters()]
    module.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(module.parameters(), flags, strict=True):
            p.requires_grad_(flag)


class GAN(Task):
    def __init__(self, data: DataModule, latent_dim: int, width: int):
        super().__init__()
        require_kind(data, "images", "gan")
        size, channels = data.image_size, data.channels
        if size not in (16, 32, 64):
            raise UserError(
                f"dataset.image_size={size} is invalid for model=gan: allowed: 16, 32, 64"
            )
        ups = {16: 2, 32: 3, 64: 4}[size]
        self.latent_dim = latent_dim
        g: list[nn.Module] = [
            nn.ConvTranspose2d(latent_dim, width * 2**ups, 4, 1, 0, bias=False),
            nn.BatchNorm2d(width * 2**ups),
            nn.ReLU(True),
        ]
        for i in range(ups, 0, -1):
            g += [
                nn.ConvTranspose2d(width * 2**i, width * 2 ** (i - 1), 4, 2, 1, bias=False),
                nn.BatchNorm2d(width * 2 ** (i - 1)),
                nn.ReLU(True),
            ]
        g.append(nn.Conv2d(width, channels, 3, 1, 1))
        self.generator = nn.Sequential(*g)
        d: list[nn.Module] = [nn.Conv2d(channels, width, 4, 2, 1), nn.LeakyReLU(0.2, True)]
        for i in range(ups):
            d += [
                nn.Conv2d(width * 2**i, width * 2 ** (i + 1), 4, 2, 1, bias=False),
                nn.BatchNorm2d(width * 2 ** (i + 1)),
                nn.LeakyReLU(0.2, True),
            ]
        d += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width * 2**ups, 1)]
        self.discriminator = nn.Sequential(*d)

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        return {
            "discriminator": list(self.discriminator.parameters()),
            "generator": list(self.generator.parameters()),
        }

    def _losses(
        self, real: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        z = torch.randn(len(real), self.latent_dim, 1, 1, device=real.device)
        fake = self.generator(z)
        d_real, d_fake = self.discriminator(real), self.discriminator(fake.detach())
        d_loss = F.binary_cross_entropy_with_logits(
            d_real, torch.ones_like(d_real), reduction="sum"
        )
        d_loss = d_loss + F.binary_cross_entropy_with_logits(
            d_fake, torch.zeros_like(d_fake), reduction="sum"
        )
        with frozen(self.discriminator):
            d_gen = self.discriminator(fake)
        g_loss = F.binary_cross_entropy_with_logits(d_gen, torch.ones_like(d_gen), reduction="sum")
        return d_loss, g_loss, d_real, d_fake, fake

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        d_loss, g_loss, *_ = self._losses(batch["image"])
        return {"discriminator": d_loss, "generator": g_loss}

    def eval_sums(self, batch: Batch) -> dict[str, torch.Tensor]:
        d_loss, g_loss, d_real, d_fake, fake = self._losses(batch["image"])
        self.predicted(fake, VALUES)  # the generator's images (from the same noise: fixed_noise)
        return {
            "loss": d_loss + g_loss,
            "loss_discriminator": d_loss,
            "loss_generator": g_loss,
            "discriminator_accuracy": (d_real > 0).sum() + (d_fake < 0).sum(),
        }

    def eval_metrics(self, totals: dict[str, float], count: int) -> dict[str, float]:
        n = max(count, 1)
        metrics = {k: v / n for k, v in totals.items()}
        metrics["discriminator_accuracy"] /= 2  # real and fake per sample
        return metrics
