"""What the person at the terminal sees: a live progress bar and a final summary table."""

from __future__ import annotations

import logging

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

console = Console(stderr=True)


def say(message: str) -> None:
    console.print(message, highlight=False)


class ProgressBar:
    def __init__(self, total: int, enabled: bool):
        self.progress = (
            Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeRemainingColumn(),
                console=console,
            )
            if enabled
            else None
        )
        if self.progress:
            self.task = self.progress.add_task("train", total=total, stats="")

    def __enter__(self) -> ProgressBar:
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress:
            self.progress.stop()

    def update(self, step: int, loss: float, loss_scale: float, samples_per_s: float) -> None:
        if self.progress:
            stats = f"loss {loss:.4f}  scale {loss_scale:g}  {samples_per_s:.1f} samples/s"
            self.progress.update(self.task, completed=step, stats=stats)


def summary_table(summary: dict) -> None:
    table = Table(title="amp-runner summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in summary.items():
        if key == "eval_precisions":  # a table of its own (runner/answers/inference.py)
            continue
        if isinstance(value, float):
            value = f"{value:.4g}"
        table.add_row(key, str(value))
    Console().print(table)


def _not_a_missing_library(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Failed to load")


def quiet_torchao() -> None:
    """torchao logs "Failed to load ..._C_*.so" for each CUDA kernel library a CPU cannot load:
    those lines are dropped, its other messages kept (fp8 and the torchao optimizers use it)."""
    logging.getLogger("torchao").addFilter(_not_a_missing_library)
