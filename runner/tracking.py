"""Where metrics go: `metrics.jsonl` (always; the source of truth), `summary.json`, and the
tracker backend (Weights & Biases). A tracker failure is a warning, never a lost metric."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from runner import console, wandb_file
from runner.errors import first_line
from runner.files import read_rows, write_text

# Set by the entry point for a multirun (and inherited by launcher subprocesses): the keys the
# sweep varies, so every job is named after the values that tell it apart.
SWEEP_KEYS_ENV = "AMP_RUNNER_SWEEP_KEYS"


def jsonable(value):
    """JSON has no inf/NaN: a diverged loss is written as the string "nan" so files stay valid."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def dumps(record: dict, indent: int | None = None) -> str:
    return json.dumps(jsonable(record), indent=indent)


def run_identity(cfg: DictConfig) -> tuple[str | None, str]:
    """(group, name): the group is the sweep (one per multirun), the name the model plus the
    values of the swept overrides, e.g. ("multirun-2026-11-29-10-00-00", "bert-bf16")."""
    group, name = cfg.logger.group, cfg.logger.name
    model = precision = None
    swept: list[str] = []
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        model, precision = hc.runtime.choices.get("model"), hc.runtime.choices.get("precision")
        if hc.mode == RunMode.MULTIRUN:
            sweep_dir = Path(hc.sweep.dir).resolve()
            group = group or f"{sweep_dir.parent.name}-{sweep_dir.name}".strip("-")
            keys = set(filter(None, os.environ.get(SWEEP_KEYS_ENV, "").split(",")))
            for override in hc.overrides.task:
                key, _, value = override.lstrip("+~").partition("=")
                if key in keys and key not in ("model", "precision"):
                    swept.append(f"{key.rsplit('.', 1)[-1]}={value}")
    parts = [model or type_name(cfg.model), precision or cfg.precision.mode, *swept]
    return group, name or "-".join(parts)


def type_name(node: DictConfig) -> str:
    return str(node.get("_target_", "model")).rsplit(".", 1)[-1].lower()


class WandbTracker:
    """One W&B run per job, in the run directory; every series plotted against `step`."""

    def __init__(self, cfg: DictConfig, out_dir: Path, run_id: str | None = None):
        import wandb

        lg = cfg.logger
        group, name = run_identity(cfg)
        config = OmegaConf.to_container(cfg, resolve=True)
        if HydraConfig.initialized():
            config["choices"] = dict(HydraConfig.get().runtime.choices)
        self.run = wandb.init(
            project=lg.project,
            entity=lg.entity,
            group=group,
            name=name,
            job_type=lg.job_type,
            tags=list(lg.tags),
            config=config,
            dir=str(out_dir),
            mode=os.environ.get("WANDB_MODE", lg.mode),
            id=run_id,  # a resumed run continues its W&B run
            resume="allow" if run_id else None,
            reinit="finish_previous",
            settings=wandb.Settings(init_timeout=lg.init_timeout_s, silent=True, console="off"),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        # The run's own clock and what it has seen, so eval metrics plot against wall time and
        # tokens too (the comparison's time to target): `train_time_s`, the sum of the steps'
        # times (no evaluation in it), and `tokens_seen` (`samples_seen` where the data has no
        # tokens); each eval metric again as `by_time/<name>` and `by_tokens/<name>`.
        for axis in ("train_time_s", "samples_seen", "tokens_seen"):
            self.run.define_metric(axis)
        self.clock = {"train_time_s": 0.0, "samples_seen": 0.0, "tokens_seen": 0.0}
        self._defined: set[str] = set()
        # The last step W&B holds of a resumed run: rows up to it are not sent again (a killed
        # run may have sent steps after its last checkpoint), rows after it are (W&B's service,
        # signalled with the trainer, may have died before the last rows reached it).
        self.held_through = self._held_through(out_dir) if run_id else 0

    def _held_through(self, out_dir: Path) -> int:
        if self.run.settings.mode == "offline":
            return wandb_file.last_step(out_dir, self.run.id) or 0
        return max(self.run.starting_step - 1, 0)  # the server's: its next step, less one

    @property
    def run_id(self) -> str:
        return self.run.id

    @property
    def offline_dir(self) -> str | None:
        return self.run.dir.removesuffix("/files") if self.run.settings.mode == "offline" else None

    def carry(self, rows: list[dict]) -> None:
        """A resumed run's clock goes on from its earlier rows; those W&B does not hold yet are
        sent now."""
        self.log(rows)

    def _tick(self, row: dict) -> None:
        dt = row.get("step_time_s")
        if isinstance(dt, int | float) and math.isfinite(dt):
            c = self.clock
            c["train_time_s"] += dt
            c["samples_seen"] += (row.get("samples_per_s") or 0.0) * dt
            c["tokens_seen"] += (row.get("tokens_per_s") or 0.0) * dt

    def _by_clock(self, row: dict) -> dict:
        """The clock, and the row's eval metrics against it (each defined on first sight)."""
        evals = {k: v for k, v in row.items() if k.startswith("eval_")}
        tokens = "tokens_seen" if self.clock["tokens_seen"] > 0 else "samples_seen"
        extra = dict(self.clock)
        for key, value in evals.items():
            if key not in self._defined:
                self.run.define_metric(f"by_time/{key}", step_metric="train_time_s")
                self.run.define_metric(f"by_tokens/{key}", step_metric=tokens)
                self._defined.add(key)
            extra |= {f"by_time/{key}": value, f"by_tokens/{key}": value}
        return extra

    def log(self, rows: list[dict]) -> None:
        for row in rows:  # at its optimizer step: a row amended with its evaluation merges in
            self._tick(row)
            if row["step"] > self.held_through:
                self.run.log(row | self._by_clock(row), step=row["step"])

    def table(self, key: str, columns: list[str], rows: list[list], step: int) -> None:
        import wandb

        # at the last step logged: merged into its row, so every history row has its step
        self.run.log({key: wandb.Table(columns=columns, data=rows), "step": step}, step=step)

    def finish(self, summary: dict, exit_code: int) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if v is not None})
        self.run.finish(exit_code=exit_code)


class RunLog:
    """One run's metrics. Rows are written (and flushed) as they come, so a crash loses nothing
    that was logged; the tracker gets the same rows."""

    def __init__(
        self,
        out_dir: Path,
        tracker: WandbTracker | None = None,
        resume_step: int | None = None,
        write: bool = True,
    ):
        """`resume_step`: keep the rows up to that step (written before the checkpoint a run
        resumes from) and drop later ones, so the file has no duplicates and no gaps.
        `write=False` (ranks other than 0): the same interface, nothing written."""
        self.out_dir = out_dir
        self.tracker = tracker
        self.previous_rows: list[dict] = []
        self._metrics = None
        self._last_row_at = 0  # where the last row logged starts in metrics.jsonl
        self._last_step: int | None = None  # the last row's step
        if not write:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "metrics.jsonl"
        if resume_step is not None:
            rows, whole = read_rows(path)
            if path.exists() and whole < path.stat().st_size:
                console.say(
                    f"[yellow]warning:[/] {path}: a line torn by a kill while it was written: cut "
                    f"there, the {len(rows)} whole rows before it kept"
                )
            self.previous_rows = [r for r in rows if r.get("step", 0) <= resume_step]
        write_text(path, "".join(dumps(r) + "\n" for r in self.previous_rows))
        self._metrics = open(path, "a", encoding="utf-8")
        if tracker is not None and hasattr(tracker, "carry"):
            tracker.carry(self.previous_rows)

    def log_rows(self, rows: list[dict]) -> None:
        if self._metrics is None:
            return
        for row in rows:
            self._last_row_at, self._last_step = self._metrics.tell(), row["step"]
            self._metrics.write(dumps(row) + "\n")
        self._metrics.flush()
        self._to_tracker("log", rows)

    def amend_last(self, row: dict, added: dict) -> None:
        """The last row logged, now with `added` (its step's evaluation, which came after the
        row was written): rewritten in place; the tracker gets `added` at the row's step."""
        if self._metrics is None:
            return
        self._metrics.truncate(self._last_row_at)
        self._metrics.write(dumps(row) + "\n")
        self._metrics.flush()
        self._to_tracker("log", [{"step": row["step"], **added}])

    def log_table(self, key: str, columns: list[str], rows: list[list]) -> None:
        """A table for the tracker only (summary.json holds its data already), at the last step
        logged."""
        if self._last_step is not None:
            self._to_tracker("table", key, columns, rows, self._last_step)

    def _to_tracker(self, method: str, *args) -> None:
        if self.tracker is None:
            return
        try:
            getattr(self.tracker, method)(*args)
        except Exception as e:  # the tracker is a convenience; metrics.jsonl is the record
            console.say(f"[yellow]warning:[/] W&B {method} failed ({e}); metrics.jsonl is complete")
            self.tracker = None

    def finish(self, summary: dict, exit_code: int = 0) -> None:
        """Write summary.json and finish the tracker run (with the exit code, on failure too)."""
        if self._metrics is None:
            return
        if not self._metrics.closed:
            self._metrics.close()
        write_text(self.out_dir / "summary.json", dumps(summary, indent=2) + "\n")
        offline_dir = self.tracker.offline_dir if self.tracker else None
        self._to_tracker("finish", summary, exit_code)
        if offline_dir:
            console.console.print(
                f"W&B run saved offline; upload it with: wandb sync {offline_dir}",
                soft_wrap=True,
                highlight=False,
            )


def finished_summary(out_dir: Path, step: int) -> dict | None:
    """The summary.json of a run that completed at `step`, or None (none, or another outcome)."""
    try:
        summary = json.loads((out_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    done = isinstance(summary, dict) and summary.get("status") == "completed"
    return summary if done and summary.get("steps") == step else None


def flat_config(config, prefix: str = "") -> dict[str, str]:
    """A config's leaves (a plain container) by dotted key, each value as JSON (lists are
    leaves)."""
    if not isinstance(config, dict):
        return {prefix: json.dumps(config, sort_keys=True)}
    flat = {}
    for key, value in config.items():
        flat |= flat_config(value, f"{prefix}{key}" if not prefix else f"{prefix}.{key}")
    return flat


def open_tracker(cfg: DictConfig, out_dir: Path, run_id: str | None = None) -> WandbTracker | None:
    """The configured tracker, or None (with a warning) when it cannot start."""
    if cfg.logger.backend != "wandb" or cfg.logger.mode == "disabled":
        return None
    try:
        return WandbTracker(cfg, out_dir, run_id)
    except Exception as e:
        first = first_line(e)
        console.say(f"[yellow]warning:[/] W&B did not start ({first}); metrics.jsonl is complete")
        return None
