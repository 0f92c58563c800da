"""A sweep's jobs as they ran: each job folder's summary.json, metrics.jsonl and .hydra/ record,
and its identity (what it ran: its resolved config less its precision mode, seed and
bookkeeping), from which the comparison groups its rows and settings."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from runner.config.commandline import ALIASES
from runner.errors import UserError
from runner.files import read_json, read_rows
from runner.folders import LAUNCHER_RECORD, SWEEP_RECORD, read_record, rerun_key
from runner.sweep_folder import member
from runner.tracking import flat_config

# Keys that say how a job was run, not what it ran: left out of its identity.
BOOKKEEPING = (
    "seed",
    "precision.mode",
    "logger",
    "runner",
    "cache_dir",
    "trainer.resume",
    "trainer.progress_bar",
    "compare",
)


@dataclass
class Job:
    folder: Path
    summary: dict
    rows: list[dict]
    config: dict
    overrides: list[str]
    verdict: str = ""  # why it failed, diverged or overflowed; its group's verdict says the rest
    figures: dict = field(default_factory=dict)
    # Set by `identify`, over the whole sweep: what it ran (every config value that varies in the
    # sweep, less its precision mode and seed), the part of that its fp32 baseline shares (all but
    # precision.*), and its row's name.
    identity: tuple = ()
    setting: tuple = ()
    label: str = ""
    # Where its smoothed eval curve reached the comparison's target (runner/compare/target.py).
    reach: dict | None = None

    @property
    def precision(self) -> str:
        return self.summary.get("precision") or self.config.get("precision", {}).get("mode", "?")


def _overridden(job: Job) -> set[str]:
    """The dotted keys its command line set (`a.b=1`, `+a.b=1`, `++a.b=1`)."""
    return {o.lstrip("+~").partition("=")[0] for o in job.overrides}


def identify(jobs: list[Job]) -> None:
    """Each job's identity, setting and label. Two jobs are seeds of one row only where their
    resolved configs agree on everything but the precision mode, the seed and bookkeeping; a
    precision.* key splits rows inside a setting (each compared with the same fp32 baseline),
    any other key splits settings. A label names the precision and the values that vary: every
    key outside precision.*, and a precision.* key where it varies within some mode or this
    job's command line set it (not staged's stages, which come with the mode; not one this job
    leaves null, as fp32's and bf16's rows beside nvfp4's recipes); a recipe by its file name,
    with as many of its folders as tell it from another job's recipe of that name."""
    flats = [
        {
            k: v
            for k, v in flat_config(j.config).items()
            if not any(k == b or k.startswith(b + ".") for b in BOOKKEEPING)
        }
        for j in jobs
    ]
    keys = sorted({k for f in flats for k in f})
    recipes = {json.loads(f.get("precision.recipe") or "null") for f in flats} - {None}
    varying = [k for k in keys if len({f.get(k) for f in flats}) > 1]
    modes = {j.precision for j in jobs}
    # A key whose value follows from the mode (staged's stages): not a variable of the sweep.
    by_mode = {
        k
        for k in varying
        if all(
            len({f.get(k) for j, f in zip(jobs, flats, strict=True) if j.precision == m}) == 1
            for m in modes
        )
    }
    for job, flat in zip(jobs, flats, strict=True):
        job.identity = tuple((k, flat.get(k)) for k in varying)
        job.setting = tuple((k, v) for k, v in job.identity if not k.startswith("precision."))
        shown = [
            k
            for k in varying
            if not k.startswith("precision.")
            or k in _overridden(job)
            or (k not in by_mode and flat.get(k) != "null")
        ]
        shown.sort(key=lambda k: k.startswith("precision."))  # the setting's keys first
        job.label = " ".join(
            [
                job.precision,
                *(f"{_name(k)}={_shown(flat.get(k), k, recipes)}" for k in shown),
            ]
        )


def _name(key: str) -> str:
    """A key as a label names it: its last part, or its alias's (precision.autopilot.enabled:
    autopilot)."""
    alias = next((a for a, full in ALIASES.items() if full == key), key)
    return alias.rsplit(".", 1)[-1]


def _shown(value: str | None, key: str = "", recipes: set = frozenset()) -> str:
    """A flattened value as a label shows it: strings bare (precision.recipe's file by its
    name, with the fewest folders that tell it from the other `recipes`' paths), the rest as
    JSON."""
    if value is None:
        return "unset"
    loaded = json.loads(value)
    if key == "precision.recipe" and isinstance(loaded, str):
        parts = Path(loaded).parts
        for n in range(1, len(parts)):
            tails = {Path(*Path(r).parts[-n:]) for r in recipes if r != loaded}
            if Path(*parts[-n:]) not in tails:
                return str(Path(*parts[-n:]))
        return loaded
    return loaded if isinstance(loaded, str) else value


def _read_job(folder: Path) -> Job:
    try:
        summary = read_json(folder / "summary.json") or {}
    except ValueError:  # torn or garbled: the job is compared without it, and named
        summary = {"status": "failed", "error": "summary.json unreadable"}
    if not isinstance(summary, dict) or not summary:
        summary = {
            "status": "failed",
            "error": "no summary.json: the job was killed or never started",
        }
    record = read_record(folder, LAUNCHER_RECORD)
    if summary.get("status") != "completed" and record:
        if record.get("state") not in (None, "COMPLETED"):
            why = record.get("why") or record["state"]
            said = summary.get("error") or summary.get("status")
            summary = summary | {"error": f"{why} ({said})" if said else why}
    rows, _ = read_rows(folder / "metrics.jsonl")  # a line a kill tore: the rows before it
    config, overrides = _hydra_record(folder / ".hydra", "config.yaml"), None
    if config is not None:
        overrides = _hydra_record(folder / ".hydra", "overrides.yaml")
    if config is None or overrides is None:  # what it ran is unknown: compared as failed
        torn = "config.yaml" if config is None else "overrides.yaml"
        summary = {"status": "failed", "error": f".hydra/{torn} unreadable"}
    return Job(folder, summary, rows, config or {}, overrides or [])


def _hydra_record(hydra_dir: Path, name: str):
    """A file of the job's .hydra/ record as plain values ({} or [] where it has none); None
    where it cannot be read (torn, garbled)."""
    if not (hydra_dir / name).exists():
        return {} if name == "config.yaml" else []
    try:
        return OmegaConf.to_container(OmegaConf.load(hydra_dir / name))
    except Exception:
        return None


def job_folders(sweep_dir: Path) -> tuple[list[Path], list[Path]]:
    """The sweep folder's job folders: those of the sweep its last command named (its
    sweep.json), and the others (another command's, left in the folder)."""
    if not sweep_dir.is_dir():
        raise UserError(f"compare: {sweep_dir} is not a folder")
    found = sorted(
        (
            p
            for p in sweep_dir.iterdir()
            if p.is_dir() and ((p / ".hydra").is_dir() or (p / "summary.json").exists())
        ),
        key=lambda p: (len(p.name), p.name),
    )
    sweep = read_record(sweep_dir, SWEEP_RECORD).get("id")
    ours = [p for p in found if member(p, sweep)]
    return ours, [p for p in found if p not in ours]


def load_sweep(sweep_dir: Path) -> list[Job]:
    """The jobs of the sweep the folder's last command named (others are not read)."""
    folders, others = job_folders(sweep_dir)
    if not folders:
        more = f" of its sweep ({len(others)} job folders of other commands)" if others else ""
        raise UserError(
            f"compare: no runs in {sweep_dir}{more} (expected job folders with .hydra/ or "
            "summary.json)"
        )
    jobs = [_read_job(f) for f in folders]
    identify(jobs)
    return jobs


def others_line(sweep_dir: Path) -> str | None:
    """One line naming the job folders in `sweep_dir` that are not of its sweep, or None."""
    _, others = job_folders(sweep_dir)
    if not others:
        return None
    command = {o for c in read_record(sweep_dir, SWEEP_RECORD).get("commands", []) for o in c}

    def told(folder: Path) -> str:  # what its command set that this sweep's does not
        own = [o for o in _read_job(folder).overrides if o not in command and not rerun_key(o)]
        return f"{folder.name} ({' '.join(own)})" if own else folder.name

    named = ", ".join(told(p) for p in others)
    return (
        f"not part of this sweep (another command's jobs, left as they are and not compared): "
        f"{named}"
    )
