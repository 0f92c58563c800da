"""What a precision mode is, declared in one place: a `Mode` says how the forward computes
(autocast dtype), whether the loss is scaled, which dtype the weights are held in and which
modules keep fp32, what the mode does to the model once, what precision truth expects of it,
and which arithmetic the device must support (also the peak its MFU is measured against). The
runner asks these, never a mode's name: a new mode is its own module.

`Precision` follows the stages and asks the mode in force; the step is the shared one
(runner/precision/step.py), which fp16_master's masters and fp8's scales hook into. A mode that
converts Linears is a `Converting` one."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from runner.precision.caps import DeviceCaps
    from runner.precision.converted import ConvertedLinears

# precision truth's reason where a weight is not fp32 in a mode that keeps fp32 weights
MIXED_WEIGHTS = "keeps fp32 weights and autocasts per op (a .half() or .to(dtype) in the model?)"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Mode:
    """One precision mode. Subclass it to override what the mode does to the model (`convert`),
    which norm layers keep fp32 (`keeps_norms_fp32`) or what precision truth expects (`expects`).
    """

    name: str
    # The arithmetic it runs in: what the device must support (DeviceCaps.support) and the peak
    # its MFU is measured against (fp16_master computes in fp16, bf16_true in bf16).
    compute: str
    autocast: torch.dtype | None = None  # the forward's autocast dtype; None: no autocast
    scales_loss: bool = False  # needs a GradScaler
    weights: str = "fp32"  # the weights' dtype outside the modules kept fp32 (islands, norms)
    masters: bool = False  # the optimizer steps fp32 master copies of the weights
    tf32: bool = False  # fp32 matmuls and convolutions in TF32
    converts: bool = (
        False  # Linears converted to its format (a `Converting` mode), computing so in it
    )
    stageable: bool = True  # a `staged` schedule can use it
    fsdp_refusal: str | None = None  # why trainer.strategy=fsdp refuses it (None: it runs)
    # The mode whose peak its MFU is also reported against (mfu_vs_<it>_peak): fp8's, bf16's, as
    # torchtitan and most papers divide an fp8 run.
    mfu_also_vs: str | None = None

    @property
    def low_dtype(self) -> torch.dtype | None:
        """The low-precision dtype its other matmuls (not converted Linears') compute in; None for
        fp32 arithmetic."""
        return self.autocast or (DTYPES[self.weights] if self.weights != "fp32" else None)

    def set_matmuls(self) -> None:
        """fp32 matmuls and convolutions, process-wide, as the mode computes them: TF32 ("high")
        or full fp32 ("highest"), explicit either way (a previous stage or job in this process
        may have left the other)."""
        torch.set_float32_matmul_precision("high" if self.tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = self.tf32

    def keeps_norms_fp32(self, cfg) -> bool:
        """Whether norm layers keep fp32 weights where the mode casts them."""
        return True

    def convert(
        self, precision, model: nn.Module, islands: Sequence[nn.Module], norms: set
    ) -> None:
        """What the mode does to the model once, before training (islands are installed in
        every mode already): nothing for an autocast mode. `precision`: the Precision in force
        (runner/precision/plan.py), whose parts (masters, converted Linears) the mode fills in."""

    def expects(self, cfg, row: dict) -> tuple[str, str]:
        """(dtype, why): the weights precision truth expects for one of its rows."""
        if self.weights == "fp32":
            return "fp32", f"precision={self.name} {MIXED_WEIGHTS}"
        if row["part"] == "adapter" and cfg.adapter_dtype == "fp32":
            return "fp32", f"precision={self.name} holds adapters in fp32 (precision.adapter_dtype)"
        norms = self.keeps_norms_fp32(cfg)
        kept = "norm layers and fp32 islands" if norms else "fp32 islands"
        island = row["autocast"] == "off (island)"
        expected = "fp32" if island or (norms and row["norm"]) else self.weights
        where = "in" if expected == "fp32" else "outside"
        return expected, f"precision={self.name} holds {expected} weights {where} {kept}"


class Converting(Mode, abc.ABC):
    """A mode whose chosen Linears are converted to its format once (fp8, mxfp8, nvfp4, mxfp4:
    runner/precision/converted.py) and compute in it in its stages; bf16 autocast for the rest."""

    # precision.fp8 keys this format ignores, each refused at validation unless unset:
    # (key, its unset value, why)
    ignored_fp8_keys: tuple[tuple[str, object, str], ...] = ()

    @abc.abstractmethod
    def linears(self, cfg, caps: DeviceCaps) -> ConvertedLinears:
        """What converts and switches its Linears (`cfg`: precision.fp8, the chooser's keys and
        the fp8 formats' own)."""

    def convert(self, precision, model: nn.Module, islands: Sequence[nn.Module], norms) -> None:
        """Converts the chosen Linears (islands left out)."""
        precision.converted.prepare(model, islands)
