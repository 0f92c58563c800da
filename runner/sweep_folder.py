"""A sweep folder is one sweep (runner/folders.py has the job folder): one command at a time, its
jobs checked against the runs the folder holds before any runs, and its identity (sweep.json),
by which the comparison reads only its own jobs."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

from omegaconf import OmegaConf

from runner.errors import UserError
from runner.files import write_text
from runner.folders import (
    LAUNCHER_RECORD,
    REFUSED,
    RUN_RECORD,
    SWEEP_RECORD,
    hold,
    holds_run,
    read_record,
    rerun_key,
)


def refusals(sweep_dir: Path) -> list[str]:
    """The jobs of the sweep that were refused their folders (`Taken`), as lines."""
    return [
        f"job {p.stem}: {p.read_text().strip()}"
        for p in sorted((sweep_dir / REFUSED).glob("*.txt"), key=lambda p: (len(p.stem), p.stem))
    ]


def adopt(folder: Path, sweep: str | None) -> None:
    """A job of this sweep that it did not run (a completed one read back): marked as the
    sweep's, so that the comparison reads it."""
    record = read_record(folder)
    if sweep and record.get("sweep") != sweep:
        write_text(folder / RUN_RECORD, json.dumps(record | {"sweep": sweep}, indent=1) + "\n")


def member(folder: Path, sweep: str | None) -> bool:
    """Whether a job folder belongs to `sweep` (None: a folder written before sweeps had an
    identity, whose jobs all belong)."""
    if sweep is None:
        return True
    if (folder / RUN_RECORD).exists() and not read_record(folder):
        return True  # its record is unreadable: shown (and named failed, where it is) not hidden
    return sweep in (
        read_record(folder).get("sweep"),
        read_record(folder, LAUNCHER_RECORD).get("sweep"),
    )


_started: dict[Path, str] = {}  # sweep folders this process started: their ids


def start_sweep(sweep_dir: Path, command: list[str], subdir: str) -> str:
    """At a sweep's start, before any job runs: its folder's lock (held to the end of this
    process), its jobs checked against the runs the folder holds (`check_jobs`), and its
    identity. A command the sweep ran before keeps its id (its jobs continue); a command whose
    job folders are all new adds its jobs to the sweep (the baseline rows and the recipe rows,
    two commands into one folder: docs/precision-modes.md); another command that takes over
    job folders of the sweep is another sweep, whose comparison reads only its own jobs. A later
    round of runner.seeds=auto, in this process, is the same sweep."""
    from runner.config.commandline import expand

    sweep_dir = sweep_dir.absolute()
    if sweep_dir in _started:
        return _started[sweep_dir]
    hold(sweep_dir)
    reused = check_jobs(sweep_dir, subdir, expand(command))
    shutil.rmtree(sweep_dir / REFUSED, ignore_errors=True)  # an earlier command's refusals
    kept = sorted(o for o in command if not rerun_key(o))
    record = read_record(sweep_dir, SWEEP_RECORD)
    commands = record.get("commands", [])
    if "id" in record and (kept in commands or not reused):
        record["commands"] = commands + ([] if kept in commands else [kept])
    else:
        sweep = hashlib.sha1(json.dumps(kept).encode()).hexdigest()[:12]
        record = {"id": sweep, "commands": [kept]}
    record["started"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_text(sweep_dir / SWEEP_RECORD, json.dumps(record, indent=1) + "\n")
    _started[sweep_dir] = record["id"]
    return record["id"]


def check_jobs(sweep_dir: Path, subdir: str, jobs: list[list[str]]) -> bool:
    """Before a sweep runs anything: each of its jobs whose folder holds a run of other
    overrides (another command's job, where this one would resume it or read it back under its
    own label) refused, in one line naming the key and both values. `subdir`: the job folders'
    name, hydra.sweep.subdir, unresolved (${hydra.job.num} in it); any other interpolation
    there is left to each job's own check (`admit`). Whether some job's folder holds a run."""
    template = subdir.replace("${hydra.job.num}", "{num}")
    if "$" in template:
        return False
    refused, reused = [], False
    for num, overrides in enumerate(jobs):
        folder = sweep_dir / template.format(num=num)
        ran_file = folder / ".hydra" / "overrides.yaml"
        if not (ran_file.exists() and holds_run(folder)):
            continue
        reused = True
        changed = _changed(folder, _values(overrides))
        if changed:
            refused.append(f"job {num} ({folder}) asks {', '.join(changed)}")
    if refused:
        n = len(refused) - 1
        more = f"; {n} more job{'s' if n > 1 else ''} too" if n else ""
        raise UserError(
            f"{sweep_dir} holds another sweep's runs: {refused[0]}{more}: give this sweep a "
            "folder of its own (hydra.sweep.dir=...), or run the command that made it"
        )
    return reused


def _changed(folder: Path, asks: dict[str, tuple]) -> list[str]:
    """The values a job's command line sets (`asks`) that its folder's run did not run, as
    "key=new (it ran: old)": against the run's own command line where it set the key, else its
    config group's choice or its recorded value. A key it no longer sets takes a default that
    only the job's own check knows (`runner.folders.admit`); so does an unreadable record."""
    try:
        ran = _values(OmegaConf.to_container(OmegaConf.load(folder / ".hydra" / "overrides.yaml")))
        hydra = OmegaConf.load(folder / ".hydra" / "hydra.yaml")
        choices = OmegaConf.to_container(hydra.hydra.runtime.choices)
    except Exception:  # torn, garbled or missing: the job's own check, when it runs, decides
        return []
    config = OmegaConf.create(read_record(folder).get("config") or {})
    converts = str(asks.get("trainer.resume_across_precision", ("",))[0]).lower() == "true"
    changed = []
    for key, (value, shown) in sorted(asks.items()):
        if rerun_key(key) or (converts and key.split(".")[0] == "precision"):
            continue
        if key in ran:
            before, said = ran[key]
        elif key in choices:
            before = said = choices[key]
        else:
            before = OmegaConf.select(config, key, default="(unset)")
            said = before
        if before != value and before != "(unset)":
            changed.append(f"{key}={shown} (it ran: {said})")
    return changed


def _values(overrides: list[str]) -> dict[str, tuple]:
    """key -> (value, as the command line writes it) of a job's overrides, parsed as Hydra
    parses them: `false` and `False`, or an interpolation escaped as Hydra saves it and as
    typed, are one value; `+k=v` and `++k=v` are `k`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([str(o) for o in overrides])
    return {
        o.get_key_element().lstrip("+~"): (o.value(), o.get_value_element_as_str()) for o in parsed
    }
