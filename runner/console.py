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


class _LoaderNoise(logging.Filter):
    """torchao's import noise, which transformers and peft trigger by themselves wherever torchao
    is installed: "Failed to load .../torchao/_C_*.so" for each kernel library this machine
    cannot load, and torch's pytree warning for each torchao Enum it registers. Kept off the
    console and written to the run's log file (Hydra's <job>.log), where a bug report finds it:
    held until a run has one. Every other record of these loggers passes."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    @staticmethod
    def is_noise(record: logging.LogRecord) -> bool:
        if record.name == "torchao":
            message = record.getMessage()
            return message.startswith("Failed to load ") and "torchao/_C" in message
        if record.name == "torch.utils._pytree" and "is an Enum subclass" in str(record.msg):
            enum = record.args[0] if isinstance(record.args, tuple) and record.args else None
            return getattr(enum, "__module__", "").startswith("torchao")
        return False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.is_noise(record):
            return True
        if not self.write_to_log_files([record]):
            self.held.append(record)
        return False

    def write_to_log_files(self, records: list[logging.LogRecord]) -> bool:
        """False where there is no log file yet (Hydra's job logging writes <job>.log)."""
        files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
        for handler in files:
            for record in records:
                handler.handle(record)
        return bool(files)


_loader_noise = _LoaderNoise()


def quiet_torchao() -> None:
    """Keeps torchao's loader noise off the console (`_LoaderNoise`). Called before anything
    imports torchao (the entry point, `run`, the modules that import it themselves)."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if _loader_noise not in logger.filters:
            logger.addFilter(_loader_noise)


def log_loader_noise() -> None:
    """The noise held so far into this run's log file (in a sweep: each job's)."""
    _loader_noise.write_to_log_files(_loader_noise.held)
