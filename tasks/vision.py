"""Images: generated classification and segmentation data (through HF `datasets`), a ResNet with
BatchNorm, and a UNet with a Dice metric."""

from __future__ import annotations

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import UserError, first_line
from runner.task import VALUES, Batch, DataModule, Task, require_kind


class _Arrays(DataModule):
    """Splits held as `datasets.Dataset` tables of numpy arrays."""

    def _configure(
        self, seed: int, batch_size: int, num_workers: int, image_size: int, channels: int
    ) -> None:
        """The checks and fields every image dataset shares."""
        if batch_size < 1:
            raise UserError(f"dataset.batch_size={batch_size} is invalid: must be ≥ 1")
        if image_size < 8 or image_size % 8:
            raise UserError(
                f"dataset.image_size={image_size} is invalid: must be a multiple of 8, ≥ 8"
            )
        self.seed, self.batch_size, self.num_workers = seed, batch_size, num_workers
        self.image_size, self.channels = image_size, channels

    def _store(self, columns: dict[str, np.ndarray], validation_fraction: float) -> None:
        self._store_table(datasets.Dataset.from_dict(columns), validation_fraction)

    def _store_table(self, table: datasets.Dataset, validation_fraction: float) -> None:
        n = len(table)
        n_val = int(n * validation_fraction)
        table = table.with_format("numpy")
        self.splits = {
            "train": table.select(range(n_val, n)),
            "validation": table.select(range(n_val)),
        }

    def split_size(self, split: str) -> int:
        return len(self.splits[split])

    def collate(self, split: str, keys: list[tuple[int, int, int]]) -> Batch:
        rows = self.splits[split][[k[2] for k in keys]]
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in rows.items()}


class SyntheticImages(_Arrays):
    """Each class is a smooth random pattern; a sample is its class's pattern, shifted, scaled and
    noisy. Learnable, but not in a handful of steps."""

    kind = "images"

    def __init__(
        self,
        seed: int,
        num_samples: int,
        num_classes: int,
        image_size: int,
        channels: int,
        batch_size: int,
        validation_fraction: float,
        num_workers: int = 0,
    ):
        self._configure(seed, batch_size, num_workers, image_size, channels)
        self.num_classes = num_classes
        rng = np.random.default_rng([seed, 21])
        coarse = rng.normal(size=(num_classes, channels, 4, 4)).astype(np.float32)
        templates = F.interpolate(torch.from_numpy(coarse), size=image_size, mode="bicubic").numpy()
        labels = rng.integers(0, num_classes, num_samples)
        shifts = rng.integers(-image_size // 8, image_size // 8 + 1, (num_samples, 2))
        images = np.stack(
            [
                np.roll(templates[c], tuple(s), axis=(1, 2))
                for c, s in zip(labels, shifts, strict=True)
            ]
        )
        images = images * rng.uniform(0.5, 1.5, (num_samples, 1, 1, 1)) + rng.normal(
            0, 1.0, images.shape
        )
        self._store(
            {"image": images.astype(np.float32), "label": labels.astype(np.int64)},
            validation_fraction,
        )


class SyntheticShapes(_Arrays):
    """Rectangles and discs of `num_classes - 1` kinds on a noisy background; the mask gives each
    pixel's class (0 = background). The kind shows in the shape's brightness pattern."""

    kind = "segmentation"

    def __init__(
        self,
        seed: int,
        num_samples: int,
        num_classes: int,
        image_size: int,
        channels: int,
        batch_size: int,
        validation_fraction: float,
        shapes_per_image: int = 3,
        num_workers: int = 0,
    ):
        self._configure(seed, batch_size, num_workers, image_size, channels)
        self.num_classes = num_classes
        rng = np.random.default_rng([seed, 31])
        colours = rng.uniform(-2, 2, (num_classes, channels)).astype(np.float32)
        yy, xx = np.mgrid[:image_size, :image_size]
        images = rng.normal(0, 0.5, (num_samples, channels, image_size, image_size)).astype(
            np.float32
        )
        masks = np.zeros((num_samples, image_size, image_size), dtype=np.int64)
        for i in range(num_samples):
            for _ in range(shapes_per_image):
                cls = int(rng.integers(1, num_classes))
                cy, cx = rng.integers(0, image_size, 2)
                r = int(rng.integers(image_size // 10, image_size // 4 + 1))
                inside = (
                    (yy - cy) ** 2 + (xx - cx) ** 2 < r * r
                    if rng.random() < 0.5
                    else (abs(yy - cy) < r) & (abs(xx - cx) < r)
                )
                masks[i][inside] = cls
                images[i][:, inside] += colours[cls][:, None]
        self._store({"image": images, "mask": masks}, validation_fraction)


class ImageFolder(_Arrays):
    """`dataset=image_folder dataset.data_dir=DIR`: one sub-folder of images per class, loaded with
    `load_dataset("imagefolder")`; resized and scaled to [-1, 1] by a `map` cached by fingerprint."""

    kind = "images"

    def __init__(
        self,
        data_dir: str,
        seed: int,
        image_size: int,
        channels: int,
        batch_size: int,
        validation_fraction: float,
        num_workers: int = 0,
    ):
        if channels not in (1, 3):
            raise UserError(f"dataset.channels={channels} is invalid: allowed: 1, 3")
        self._configure(seed, batch_size, num_workers, image_size, channels)
        try:
            table = datasets.load_dataset("imagefolder", data_dir=data_dir, split="train")
        except Exception as e:
            first = first_line(e)
            raise UserError(f"dataset.data_dir={data_dir!r}: cannot load images: {first}") from None
        if "label" not in table.column_names:
            raise UserError(
                f"dataset.data_dir={data_dir!r}: put the images in one sub-folder per class"
            )
        self.num_classes = table.features["label"].num_classes
        mode = "RGB" if channels == 3 else "L"

        def to_arrays(rows):
            images = []
            for img in rows["image"]:
                pixels = np.asarray(img.convert(mode).resize((image_size, image_size)), np.float32)
                pixels = pixels if pixels.ndim == 3 else pixels[..., None]
                images.append(pixels.transpose(2, 0, 1) / 127.5 - 1)
            return {"image": images, "label": rows["label"]}

        features = datasets.Features(
            {
                "image": datasets.Array3D((channels, image_size, image_size), "float32"),
                "label": datasets.Value("int64"),
            }
        )
        table = table.map(
            to_arrays,
            batched=True,
            remove_columns=table.column_names,
            features=features,
            new_fingerprint=f"{table._fingerprint}-{image_size}-{channels}",
        )
        self._store_table(table.shuffle(seed=seed), validation_fraction)


def _conv_bn(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    ]


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            *_conv_bn(cin, cout, stride),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.skip = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


class ResNet(Task):
    """A ResNet of BasicBlocks with BatchNorm. Its statistics stay fp32 (the module is never cast;
    autocast runs batch_norm in fp32)."""

    def __init__(
        self, data: DataModule, width: int, blocks_per_stage: list[int], channels_last: bool = False
    ):
        super().__init__()
        require_kind(data, "images", "resnet")
        self.channels_last = channels_last
        layers: list[nn.Module] = _conv_bn(data.channels, width)
        cin = width
        for i, blocks in enumerate(blocks_per_stage):
            cout = width * 2**i
            for b in range(blocks):
                layers.append(_BasicBlock(cin, cout, 2 if b == 0 and i > 0 else 1))
                cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, data.num_classes)
        if channels_last:
            self.to(memory_format=torch.channels_last)

    def logits(self, batch: Batch) -> torch.Tensor:
        x = batch["image"]
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.head(self.features(x).mean((2, 3)))

    def forward(self, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(self.logits(batch), batch["label"], reduction="sum")

    def eval_sums(self, batch: Batch) -> dict[str, torch.Tensor]:
        logits = self.predicted(self.logits(batch))
        return {
            "loss": F.cross_entropy(logits, batch["label"], reduction="sum"),
            "accuracy": (logits.argmax(-1) == batch["label"]).sum(),
        }


class UNet(Task):
    """Encoder-decoder with skip connections; per-pixel cross-entropy; mean Dice over classes."""

    def __init__(self, data: DataModule, width: int, depth: int, channels_last: bool = False):
        super().__init__()
        require_kind(data, "segmentation", "unet")
        if data.image_size % 2**depth:
            raise UserError(
                f"dataset.image_size={data.image_size} is invalid for model.depth={depth}: "
                f"must be a multiple of {2**depth}"
            )
        self.channels_last, self.num_classes = channels_last, data.num_classes
        widths = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList()
        cin = data.channels
        for w in widths:
            self.down.append(nn.Sequential(*_conv_bn(cin, w), *_conv_bn(w, w)))
            cin = w
        self.up = nn.ModuleList(nn.ConvTranspose2d(w * 2, w, 2, 2) for w in reversed(widths[:-1]))
        self.merge = nn.ModuleList(
            nn.Sequential(*_conv_bn(w * 2, w), *_conv_bn(w, w)) for w in reversed(widths[:-1])
        )
        self.out = nn.Conv2d(width, data.num_classes, 1)
        if channels_last:
            self.to(memory_format=torch.channels_last)

    def logits(self, batch: Batch) -> torch.Tensor:
        x = batch["image"]
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips[:-1]), strict=True):
            x = merge(torch.cat([up(x), skip], 1))
        return self.out(x)

    def forward(self, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(self.logits(batch), batch["mask"], reduction="sum")

    def num_targets(self, batch: Batch) -> int:
        return batch["mask"].numel()

    def eval_sums(self, batch: Batch) -> dict[str, torch.Tensor]:
        logits = self.predicted(self.logits(batch), VALUES)  # per-pixel logits
        pred = F.one_hot(logits.argmax(1), self.num_classes)
        true = F.one_hot(batch["mask"], self.num_classes)
        sums = {"loss": F.cross_entropy(logits, batch["mask"], reduction="sum")}
        for c in range(self.num_classes):
            sums[f"intersection_{c}"] = (pred[..., c] * true[..., c]).sum()
            sums[f"total_{c}"] = pred[..., c].sum() + true[..., c].sum()
        return sums

    def eval_metrics(self, totals: dict[str, float], count: int) -> dict[str, float]:
        dice = [
            2 * totals[f"intersection_{c}"] / totals[f"total_{c}"]
            for c in range(self.num_classes)
            if totals[f"total_{c}"] > 0
        ]
        return {"loss": totals["loss"] / max(count, 1), "dice": sum(dice) / max(len(dice), 1)}
