"""What a docs command names but the reader brings (their model, their package, their corpus),
made small here, offline: `python -m tests.docs.supply WHAT` in the command's folder. The table
(tests/docs/table.py) says which command gets which, and why."""

from __future__ import annotations

import random
import sys
from pathlib import Path

WORDS = ["the", "a", "film", "was", "it", "plot", "and", "cast", "very", "quite", "so", "end"]


def corpus(path: Path, lines: int = 60) -> None:
    rng = random.Random(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(" ".join(rng.choices(WORDS, k=30)) for _ in range(lines)) + "\n")


def llama(folder: Path) -> None:
    """A tiny Llama and its tokenizer, saved with save_pretrained (tests/test_norms.py's)."""
    from tests.test_norms import tiny_llama

    tiny_llama(folder)


MYPKG_NETS = """from torch import nn


class Net(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))

    def forward(self, x):
        return self.layers(x)
"""
MYPKG_DATA = """import torch
from torch.utils.data import TensorDataset


def _pairs(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


def train_set():
    return _pairs(256, 0)


def val_set():
    return _pairs(64, 1)
"""


def mypkg(folder: Path) -> None:
    """The docs' `mypkg.nets.Net` and `mypkg.data.train_set` / `val_set`: a reader's package."""
    pkg = folder / "mypkg"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(MYPKG_NETS)
    (pkg / "data.py").write_text(MYPKG_DATA)


if __name__ == "__main__":
    what, *args = sys.argv[1:]
    if what == "llama":
        llama(Path(args[0]))
    elif what == "corpus":
        corpus(Path(args[0]))
    elif what == "mypkg":
        mypkg(Path.cwd())
    else:
        sys.exit(f"error: unknown {what!r}")
