"""Noisy images of horizontal, vertical or diagonal stripes: (image, label) pairs from a plain
torch Dataset, the way a user's own data arrives."""

import torch
from torch.utils.data import Dataset


class Stripes(Dataset):
    def __init__(self, num_samples: int = 512, image_size: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 3, (num_samples,), generator=g)
        ys, xs = torch.meshgrid(torch.arange(image_size), torch.arange(image_size), indexing="ij")
        patterns = torch.stack([ys % 4 < 2, xs % 4 < 2, (xs + ys) % 4 < 2]).float()
        noise = torch.randn(num_samples, 1, image_size, image_size, generator=g)
        self.images = patterns[self.labels].unsqueeze(1) + noise

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]


def validation_set(num_samples: int = 128, image_size: int = 16) -> Stripes:
    return Stripes(num_samples, image_size, seed=1)
