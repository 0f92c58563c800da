"""Inference in the precision you will deploy (`runner.eval_precisions`): after training, the final
weights (as a plain fp32 model: `trained_weights`) evaluated in each precision: autocast in its
dtype, or (`*_cast`) the model cast with `.to(dtype)` and run without autocast, as models are
often deployed. Each batch goes through every precision in turn (one evaluation loop:
runner/train/evaluation.py), so each is measured against the fp32 evaluation of the same batch:
the metrics' change, and the gap in outputs (the mean KL divergence of the predicted
distribution; for values, each sample's relative error). A precision whose outputs are
non-finite is the row "overflow"; one that fails, the row "error"."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

from runner.answers.inference_weights import cast_copy, trained_weights
from runner.errors import first_line
from runner.measure.matmuls import recording
from runner.task import DISTRIBUTION, Task
from runner.train.evaluation import Evaluation, Predictions, Variant, evaluating, run

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
REFERENCE = "fp32"
CHUNK = 2**24  # logits compared at a time, in float64 (128 MiB): a large vocabulary's fit


@contextlib.contextmanager
def true_fp32() -> Iterator[None]:
    """fp32 matmuls and convolutions without TF32, whatever the training mode left set."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


def _kl(ours: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Σ KL(reference ‖ ours) over the rows, in float64: the gaps are small, and fp32's rounding
    in their sum is not. A class the reference rules out (p = 0) adds nothing."""
    log_p, log_r = (F.log_softmax(x.double(), -1) for x in (ours, reference))
    return torch.where(log_r.isneginf(), 0.0, log_r.exp() * (log_r - log_p)).sum()


@dataclass
class Gap:
    """How far one precision's predictions are from the reference's, summed on the device."""

    kl: torch.Tensor | float = 0.0  # over the predicted distributions (rows)
    rows: int = 0
    relative: torch.Tensor | float = 0.0  # each sample's ‖ours − reference‖ / ‖reference‖
    worst: torch.Tensor | float = 0.0
    samples: int = 0

    def add(self, ours: Predictions, reference: Predictions) -> None:
        for (kind, p), (_, r) in zip(ours, reference, strict=True):
            if kind == DISTRIBUTION:
                p, r = p.reshape(-1, p.shape[-1]), r.reshape(-1, r.shape[-1])
                step = CHUNK // r.shape[1] + 1
                for start in range(0, len(r), step):
                    self.kl = self.kl + _kl(p[start : start + step], r[start : start + step])
                self.rows += len(r)
            else:
                p, r = p.float().reshape(len(p), -1), r.float().reshape(len(r), -1)
                tiny = torch.finfo(torch.float32).tiny
                relative = (p - r).norm(dim=1) / r.norm(dim=1).clamp_min(tiny)
                self.relative, self.samples = self.relative + relative.sum(), self.samples + len(p)
                self.worst = torch.maximum(torch.as_tensor(self.worst), relative.max())

    def figures(self) -> dict[str, float]:
        out = {}
        if self.rows:
            out["kl_mean"] = float(self.kl) / self.rows
        if self.samples:
            out |= {"rel_error_max": float(self.worst), "rel_error_mean": float(self.relative)}
            out["rel_error_mean"] /= self.samples
        return out


@dataclass
class Deployed(Variant):
    """One precision's evaluation: an error is its row's, not the run's."""

    name: str = ""
    failed: str | None = None
    finite: torch.Tensor | bool = True  # every prediction so far, on the device
    gap: Gap = field(default_factory=Gap)
    recorded: dict | None = None  # the reference's: its first batch's matmuls, filled there

    def evaluate(self, index: int, batch) -> Predictions | None:
        if self.failed:
            return None
        device = next(iter(batch.values())).device
        # the reference's first batch, for the precision manifest: what it really computed in
        audited = self.name == REFERENCE and self.recorded is not None and index == 0
        try:
            # The same random draws (a GAN's noise) for every precision: batch by batch
            with (
                torch.random.fork_rng([device] if device.type == "cuda" else []),
                recording(self.task) if audited else contextlib.nullcontext() as seen,
            ):
                torch.manual_seed(index)
                predictions = super().evaluate(index, batch)
            if audited:
                self.recorded |= seen
        except Exception as e:
            self.failed = first_line(e)
            return None
        for _, p in predictions:
            self.finite = torch.isfinite(p).all() & self.finite
        return predictions

    def row(self, count: int, reference: dict | None) -> dict:
        if self.failed:
            return {"status": "error", "error": self.failed}
        metrics = self.metrics(count)
        values = [v for v in metrics.values() if isinstance(v, float)]
        if not bool(self.finite) or not all(map(math.isfinite, values)):
            return {"status": "overflow", "metrics": dict.fromkeys(metrics, math.nan)}
        ok = reference is not None and reference["status"] == "ok"
        change = {k: v - reference["metrics"][k] for k, v in metrics.items()} if ok else {}
        return {"status": "ok", "metrics": metrics, "change": change, **self.gap.figures()}


def _deployed(name: str, reference: Task) -> Deployed:
    dtype = DTYPES[name.removesuffix("_cast")]
    if name.endswith("_cast"):
        try:
            return Deployed(cast_copy(reference, dtype), name=name)
        except Exception as e:  # a model that cannot be copied (compiled ...)
            return Deployed(reference, name=name, failed=f"the cast copy failed: {first_line(e)}")
    device = next(reference.parameters()).device.type
    autocast = (lambda: torch.autocast(device, dtype=dtype)) if name != REFERENCE else None
    return Deployed(reference, autocast or contextlib.nullcontext, name=name)


def evaluate_precisions(
    evaluation: Evaluation,
    names: Sequence[str],
    masters: Mapping[nn.Parameter, nn.Parameter] | None = None,
    recorded: dict | None = None,
) -> dict:
    """summary.json's `eval_precisions`: {precision: its row}, fp32 (the reference: the trained
    weights, `masters` where the mode keeps fp32 masters, `trained_weights`) first; {} where
    none are asked for or there is no validation data. `recorded`: filled with the reference's
    first batch as the precision manifest records it (its matmuls, its modules' outputs)."""
    loader = evaluation.data.val_loader(evaluation.limit_val_batches) if names else None
    if loader is None:
        return {}
    reference = trained_weights(evaluation.task, masters or {})
    order = [REFERENCE, *(n for n in dict.fromkeys(names) if n != REFERENCE)]
    variants = [_deployed(name, reference) for name in order]
    variants[0].recorded = recorded

    def compare(predictions: list[Predictions | None]) -> None:
        if predictions[0] is None:
            return
        for variant, ours in zip(variants[1:], predictions[1:], strict=True):
            if ours is not None:
                variant.gap.add(ours, predictions[0])

    with true_fp32(), evaluating(*dict.fromkeys(v.task for v in variants)):
        count = run(variants, loader, evaluation.to_device, compare)
    reference_row = variants[0].row(count, None)
    rows = {v.name: v.row(count, reference_row) for v in variants}  # fp32's change: 0
    show([line[1:] for line in table({"": rows})])
    return {"eval_precisions": rows}


def _figure(value) -> str:
    return "—" if value is None else f"{float(value):.4g}"  # float(): "nan" read from JSON


def _gap(row: dict) -> str:
    if "kl_mean" in row:
        return f"KL {row['kl_mean']:.3g}"
    if "rel_error_max" in row:
        return f"rel. error max {row['rel_error_max']:.3g}, mean {row['rel_error_mean']:.3g}"
    return "—"


def table(runs: dict[str, dict]) -> list[list[str]]:
    """Header and rows: for each run (by its label), each precision it was evaluated in, with
    each metric and its change from the fp32 evaluation, and the output gap."""
    metrics = list(
        dict.fromkeys(
            k for rows in runs.values() for r in rows.values() for k in r.get("metrics", {})
        )
    )
    header = ["trained", "evaluated in", "status", *metrics, "output gap vs fp32"]
    out = [header]
    for label, rows in runs.items():
        for name, r in rows.items():
            cells = []
            for key in metrics:
                value, change = r.get("metrics", {}).get(key), r.get("change", {}).get(key)
                delta = f" ({change:+.3g})" if change is not None and name != REFERENCE else ""
                cells.append(_figure(value) + delta)
            status = r["status"] if r["status"] != "error" else f"error: {r['error']}"
            gap = "reference" if name == REFERENCE and r["status"] == "ok" else _gap(r)
            out.append([label, name, status, *cells, gap])
    return out


def show(rows: list[list[str]], title: str = "inference precision (the final weights)") -> None:
    shown = Table(title=title, title_justify="left")
    for name in rows[0]:
        shown.add_column(name)
    for row in rows[1:]:
        shown.add_row(*row)
    Console().print(shown)
