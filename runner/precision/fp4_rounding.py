"""The FP4 recipe of one run (runner/precision/fp4.py's Linears round by it): the format and its
switches, the run's random Hadamard transform, each rank's stochastic rounding generators and
the tiles' health counts; and the GEMMs of quantized operands (`amp_runner::fp4_mm`), or of
unquantized ones where a recipe rule keeps a direction high (runner/precision/recipe.py)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from runner.precision.fp4_mm import _mm
from runner.precision.fp4_quant import HADAMARD_SIZE, Fp4Format, Quantized, hadamard, quantize
from runner.precision.layers import recomputing

# --- the recipe ----------------------------------------------------------------------------


@dataclass
class Recipe:
    """One run's FP4 recipe: the format and its switches, the run's random Hadamard transform
    and this rank's stochastic rounding generators (one per device, seeded from the seed and the
    rank, their states checkpointed: `sr_state`), and the tiles' health counts (per module class
    and tensor: blocks, saturated, underflow). Shared, not copied, by a deep copy of the model."""

    fmt: Fp4Format
    weight_2d: bool = True
    rht: bool = True
    sr: bool = True
    quantize: bool = True  # off: the recipe's transforms without its rounding (tests)
    seed: int = 0
    rank: int = 0  # under DDP/FSDP each rank rounds with its own stream
    counts: dict = field(default_factory=lambda: defaultdict(lambda: torch.zeros(3)))
    _rht: Tensor | None = None
    _generators: dict = field(default_factory=dict)
    _saved: dict = field(default_factory=dict)  # a checkpoint's states, for devices not yet used

    def __deepcopy__(self, memo) -> Recipe:
        return self

    def transform(self) -> Tensor:
        if self._rht is None:
            g = torch.Generator().manual_seed(self.seed)
            signs = torch.randint(0, 2, (HADAMARD_SIZE,), generator=g).float() * 2 - 1
            self._rht = hadamard(signs)
        return self._rht

    def generator(self, device: torch.device) -> torch.Generator:
        """The device's stochastic rounding generator: as a checkpoint left it, else seeded."""
        key = str(device)
        if key not in self._generators:
            g = torch.Generator(device=device).manual_seed(sr_seed(self.seed, self.rank))
            if (saved := self._saved.pop(key, None)) is not None:
                g.set_state(saved)
            self._generators[key] = g
        return self._generators[key]

    def sr_state(self) -> dict[str, Tensor]:
        """The generators' states by device, for a checkpoint (runner/train/checkpoint.py)."""
        return self._saved | {key: g.get_state() for key, g in self._generators.items()}

    def load_sr_state(self, states: dict[str, Tensor]) -> None:
        """A checkpoint's `sr_state` (this rank's): each device's generator continues from it."""
        self._generators.clear()
        self._saved = dict(states)

    def q(self, x: Tensor, kind: str, tensor: str, tile=None, stochastic=False) -> Quantized:
        """`x` quantized, its tiles' health counted under (module class, tensor)."""
        if not self.quantize:
            return _exact(x, tile or (1, self.fmt.block))
        gen = self.generator(x.device) if stochastic else None
        out = quantize(x, self.fmt, tile, stochastic, gen)
        if not recomputing():
            counts = torch.stack(
                (
                    torch.tensor(float(out.saturated.numel()), device=x.device),
                    out.saturated.sum().float(),
                    out.underflow.sum().float(),
                )
            )
            key = (kind, tensor)
            self.counts[key] = self.counts[key].to(x.device) + counts
        return out

    def rotate(self, t: Tensor) -> Tensor:
        """H applied along the rows (tokens) of `t`, 16 at a time: the signs, then the fast
        Walsh-Hadamard transform's butterflies (adds and subtracts, as a kernel fuses it into
        the quantization: no matmul for the manifest to see), over 4."""
        rows, cols = t.shape
        signs = self.transform()[0].sign().to(t.device)  # Sylvester's first row is all ones
        x = t.reshape(rows // HADAMARD_SIZE, HADAMARD_SIZE, cols) * signs[:, None]
        h = 1
        while h < HADAMARD_SIZE:
            x = x.reshape(x.shape[0], HADAMARD_SIZE // (2 * h), 2, h, cols)
            x = torch.stack((x[:, :, 0] + x[:, :, 1], x[:, :, 0] - x[:, :, 1]), dim=2)
            h *= 2
        return x.reshape(rows, cols) / HADAMARD_SIZE**0.5


def sr_seed(seed: int, rank: int) -> int:
    """The stochastic rounding generators' seed: rank 0's is one process's (seed + 1), the other
    ranks' apart in their low 32 bits (all a CPU generator's Mersenne Twister keeps), by an odd
    step (2³²/φ): no two ranks of a run draw the same stream."""
    return seed + 1 + rank * 0x9E3779B9


class _Exact(Quantized):
    """Values kept as they are (Recipe.quantize off), for the transforms' own tests."""

    def packed(self):
        raise RuntimeError("exact values are not packed")


def _exact(x: Tensor, tile) -> Quantized:
    return _Exact(x.float(), torch.ones(1, 1), torch.ones(()), tile)


def _matmul(a: Quantized, b: Quantized, roles: str) -> Tensor:
    if isinstance(a, _Exact):
        return a.codes @ b.codes.t()
    return _mm(a, b, roles)


def high_mm(a: Tensor, b: Tensor, fmt: str) -> Tensor:
    """a @ bᵀ in `fmt` (bf16 or fp32) from the unquantized operands: a direction a recipe rule
    keeps high, computed as autocast's or fp32's GEMM is (its result in fp32)."""
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    return (a.to(dtype) @ b.to(dtype).t()).float()
