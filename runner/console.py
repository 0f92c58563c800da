"""What the person at the terminal sees: a live progress bar and a final summary table."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from runner.summary_aliases import converted_section

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


def _mb(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _known(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


_PHASES = {  # summary.json's `wall_time` (runner/train/wall_time.py), as printed
    "startup_s": "startup",
    "audited_step_s": "audited step",
    "warmup_steps_s": "warm-up",
    "steady_steps_s": "steady steps",
    "evaluation_s": "evaluation",
    "checkpoints_s": "checkpoints",
    "logging_s": "logging",
    "teardown_s": "teardown",
}


def wall_time_words(wall: dict) -> str:
    """ "142 s: startup 12.1 s (imports 5.0 s) · audited step 3.2 s · ...": the phases over 0.05 s."""
    parts = []
    for key, name in _PHASES.items():
        if _known(wall.get(key)) and wall[key] >= 0.05:
            imports = (wall.get("startup_parts") or {}).get("imports_s") or 0
            more = f" (imports {imports:.1f} s)" if key == "startup_s" and imports >= 0.05 else ""
            parts.append(f"{name} {wall[key]:.1f} s{more}")
    return f"{wall.get('total_s', math.nan):.1f} s: " + " · ".join(parts)


def _summary_rows(s: dict) -> list[tuple[str, str]]:
    """The lines a person reads first, each only where the run measured it."""
    rows = []
    status = [s.get("status", "?")]
    if _known(s.get("steps")):
        skipped = s.get("skipped_steps")
        status.append(f"{s['steps']} steps" + (f" ({skipped} skipped)" if skipped else ""))
    if _known(s.get("wall_time_s")):
        status.append(f"{s['wall_time_s']:.1f} s")
    rows.append(("status", " · ".join(status)))
    loss = [f"final {s['final_loss']:.4f}"] if _known(s.get("final_loss")) else []
    if _known(s.get("eval_loss")):
        best = s.get("best_eval_loss")
        same = not _known(best) or f"{best:.4f}" == f"{s['eval_loss']:.4f}"
        loss.append(f"eval {s['eval_loss']:.4f}" + ("" if same else f" (best {best:.4f})"))
    for key, value in s.items():  # the task's own metrics: eval_accuracy, ...
        if key.startswith("eval_") and key != "eval_loss" and isinstance(value, float):
            loss.append(f"{key.removeprefix('eval_')} {value:.4g}")
    if loss:
        rows.append(("loss", " · ".join(loss)))
    if _known(s.get("samples_per_s")):
        iqr = s.get("samples_per_s_iqr")
        speed = [
            f"{s['samples_per_s']:.1f} samples/s" + (f" (IQR {iqr:.1f})" if _known(iqr) else "")
        ]
        if _known(s.get("tokens_per_s")):
            speed.append(f"{s['tokens_per_s']:,.0f} tokens/s")
        if _known(s.get("step_time_s")):
            speed.append(f"step {s['step_time_s'] * 1000:.1f} ms")
        if s.get("speed_contended"):  # runner/train/speed.py: said, and untested
            speed.append(f"contended: {(s.get('contention') or {}).get('words')} — untested")
        rows.append(("speed", " · ".join(speed)))
    elif s.get("speed_note"):
        rows.append(("speed", "untested"))
    if _known(s.get("mfu")):
        peak = (
            f" of {s['peak_tflops']:.3g} TFLOPS ({s.get('peak_mode')} peak)"
            if _known(s.get("peak_tflops"))
            else ""
        )
        rows.append(("MFU", f"{s['mfu']:.2%}{peak}"))
    if isinstance(s.get("wall_time"), dict):
        rows.append(("wall time", wall_time_words(s["wall_time"])))
    if s.get("precision"):
        requested = s.get("precision_requested")
        asked = f" (asked: {requested})" if requested and requested != s["precision"] else ""
        reason = f" — {s['precision_reason']}" if s.get("precision_reason") else ""
        rows.append(("precision", f"{s['precision']}{asked}{reason}"))
    truth = s.get("precision_truth")
    if isinstance(truth, dict):
        wrong = len(truth.get("mismatches") or [])
        rows.append(("precision truth", f"{wrong} mismatches" if wrong else "as planned"))
    if "plan_held" in s:
        rows.append(("plan held", "yes" if s["plan_held"] else "no"))
    health = s.get("fp16_health")
    if isinstance(health, dict) and health.get("recommendation"):
        rows.append(
            (
                "fp16 health",
                "ok" if health["recommendation"].startswith("ok") else "needs a change (below)",
            )
        )
    if _known(s.get("peak_memory_mb")):
        rows.append(("peak memory", f"{_mb(s['peak_memory_mb'])} MB"))
    return rows


_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}


def _memory_table(memory) -> Table | None:
    """summary.json's `memory` (runner/measure/memory.py): MB by category, with their dtypes."""
    if not isinstance(memory, dict):
        return None
    table = Table(title="memory by category", title_justify="left", box=None, padding=(0, 2, 0, 0))
    for name, justify in (("", "left"), ("MB", "right"), ("dtypes", "left")):
        table.add_column(name, justify=justify, style="bold" if not name else None)
    for category, part in memory.items():
        if isinstance(part, dict) and _known(part.get("mb")) and part["mb"] > 0:
            by_dtype = part.get("by_dtype") or {}
            dtypes = ", ".join(  # each dtype's MB where there are several
                _DTYPES.get(d, d) + (f" {_mb(mb)}" if len(by_dtype) > 1 else "")
                for d, mb in by_dtype.items()
            )
            table.add_row(category, _mb(part["mb"]), dtypes)
    for key in ("total", "peak"):
        if _known(memory.get(key)):
            table.add_row(key, _mb(memory[key]), "")
    return table if table.rows else None


def _next_steps(s: dict, path: Path | None) -> list[str]:
    """What to look at next: what the run found wrong, then where the rest is."""
    steps = []
    health = s.get("fp16_health")
    if isinstance(health, dict) and not str(health.get("recommendation", "ok")).startswith("ok"):
        steps.append(f"fp16 health: {health['recommendation']}")
    manifest = s.get("precision_manifest")
    mismatches = manifest.get("mismatches") if isinstance(manifest, dict) else None
    if s.get("plan_held") is False:
        steps.append(
            "the precision plan did not hold" + (f": {mismatches[0]}" if mismatches else "")
        )
    truth = s.get("precision_truth")
    if isinstance(truth, dict) and truth.get("mismatches"):
        steps.append(f"precision truth: {truth['mismatches'][0]} (the table at the run's start)")
    converted = converted_section(s)
    if converted.get("nothing_converted"):  # a converting mode that did not
        steps.append(f"{s.get('precision', 'the mode')} {converted['nothing_converted']}")
    for key in ("speed_note", "peak_note"):
        if s.get(key):
            steps.append(s[key])
    where = f"{path}" if path else "summary.json"
    steps.append(f"every figure: {where} (runner.summary=full prints them all)")
    return steps


def _flat(summary: dict, prefix: str = "") -> list[tuple[str, str]]:
    rows = []
    for key, value in summary.items():
        if type(value) is dict and value:  # a Truth prints as its one line
            rows += _flat(value, f"{prefix}{key}.")
        else:
            rows.append(
                (f"{prefix}{key}", f"{value:.4g}" if isinstance(value, float) else str(value))
            )
    return rows


def summary_table(summary: dict, detail: str = "short", path: Path | None = None) -> None:
    """The end of a run on stdout: the figures a person came for (detail=short), or every key of
    summary.json, nested ones by their dotted path (detail=full: runner.summary=full)."""
    out = Console()
    table = Table(title="amp-runner summary", show_header=False, title_justify="left", box=None)
    table.add_column(style="bold")
    table.add_column()
    if detail == "full":
        for key, value in _flat({k: v for k, v in summary.items() if k != "eval_precisions"}):
            table.add_row(key, value)  # eval_precisions: a table of its own (answers/inference.py)
        out.print(table)
        return
    for key, value in _summary_rows(summary):
        table.add_row(key, value)
    out.print(table)
    if memory := _memory_table(summary.get("memory")):
        out.print(memory)
    for step in _next_steps(summary, path):
        out.print(f"next: {step}", highlight=False, soft_wrap=True)


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
