"""A job folder is one run: one config, one writer at a time, one W&B run. A sweep folder is one
sweep: one command at a time, and the comparison reads only the jobs of the sweep its command
names. Everything that reads a folder later (a rerun, the comparison, W&B) relies on this.

Files: `.lock` (held while a process writes the folder; it names that process), `run.json` in
a job folder (the run's resolved config, its sweep and its W&B run id, written when the run
starts) and `sweep.json` in a sweep folder (the sweep's identity and command, written when the
sweep starts)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import socket
import string
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from runner.errors import UserError, clip
from runner.files import read_json, remove_stale, write_text
from runner.train.resume_check import RERUN_KEYS, unapplied

LOCK, RUN_RECORD, SWEEP_RECORD = ".lock", "run.json", "sweep.json"
_held: dict[Path, int] = {}  # folder -> the descriptor whose flock this process holds


class Busy(UserError):
    """Another process writes the folder."""


def hold(folder: Path) -> None:
    """Take `folder`'s lock for this process, or refuse in one line naming who holds it. The
    kernel drops the lock with the process, so a killed run never leaves a folder locked."""
    folder = folder.absolute()
    if folder in _held:
        return
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 2048, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise Busy(
            f"{folder} is in use by {holder}: wait for it to end (or stop it), or give this "
            "command a folder of its own"
        ) from None
    os.ftruncate(fd, 0)
    program = "python -m runner" if sys.argv[0].endswith("__main__.py") else Path(sys.argv[0]).name
    command = clip(" ".join([program, *sys.argv[1:]]), 160)
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    holder = f"process {os.getpid()} on {socket.gethostname()} since {since} ({command})"
    os.pwrite(fd, holder.encode() + b"\n", 0)
    _held[folder] = fd


def release(folder: Path) -> None:
    fd = _held.pop(folder.absolute(), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor drops the flock


def holds_run(folder: Path) -> bool:
    """Whether `folder` holds a run's outcome or progress (a row, a summary, a checkpoint)."""
    metrics = folder / "metrics.jsonl"
    checkpoints = folder / "checkpoints"
    return (
        (metrics.exists() and metrics.stat().st_size > 0)
        or (folder / "summary.json").exists()
        or (checkpoints.is_dir() and any(checkpoints.iterdir()))
    )


def read_record(folder: Path, name: str = RUN_RECORD) -> dict:
    try:
        record = read_json(folder / name)
    except ValueError:
        record = None
    return record if isinstance(record, dict) else {}


def new_run_id() -> str:
    """A W&B run id (W&B's own form: 8 lowercase letters and digits)."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def admit(folder: Path, cfg: DictConfig, resume: tuple | None, finished: bool, main: bool) -> str:
    """Before anything in `folder` is written: refuse a command whose values are not those of
    the run the folder holds (one line naming each key and both values), then record this run
    (.hydra/, run.json) with its sweep and W&B run id; the id. `resume`: the checkpoint to resume
    from, (path, state); `finished`: the run had reached its max_steps."""
    record = read_record(folder)
    state = resume[1] if resume else None
    own = resume is not None and folder.absolute() in Path(resume[0]).absolute().parents
    if holds_run(folder):
        saved = record.get("config") or (state.get("config") if own else None)
        allowed = ("precision",) if cfg.trainer.resume_across_precision else ()
        changed = unapplied(saved, cfg, allowed)
        if changed:
            raise UserError(_refusal(folder, resume, finished, changed))
    run_id = record.get("wandb_run_id") or (state.get("wandb_run_id") if own else None)
    run_id = run_id or new_run_id()
    if main:
        _write_hydra_files(folder, cfg)
        config = OmegaConf.to_container(cfg, resolve=True)
        mine = {"config": config, "sweep": current_sweep(), "wandb_run_id": run_id}
        write_text(folder / RUN_RECORD, json.dumps(record | mine, indent=1) + "\n")
    return run_id


def _refusal(folder: Path, resume: tuple | None, finished: bool, changed: list[str]) -> str:
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    values = ", ".join(changed[:3]) + more
    step = resume[1]["step"] if resume else None
    if finished:
        what = f"{resume[0]} is at step {step}: the run had finished, so {values} would not apply"
    elif resume:
        what = (
            f"{folder} holds a run stopped at step {step} with other values: {values}; resuming "
            "it would continue the old run under the new values"
        )
    else:
        what = f"{folder} holds a run of other values: {values}"
    convert = (
        ", or convert it (trainer.resume_across_precision=true)"
        if all(c.startswith("precision.") for c in changed) and resume and not finished
        else ""
    )
    return (
        f"{what}: give the new run a folder of its own (hydra.run.dir=..., or another "
        f"hydra.sweep.dir), or rerun without them{convert}"
    )


def _write_hydra_files(folder: Path, cfg: DictConfig) -> None:
    """.hydra/ as Hydra writes it (config.yaml, hydra.yaml, overrides.yaml), written here only
    once the command is admitted: Hydra's own writing is off (conf/config.yaml sets
    hydra.output_subdir to null), as it would rewrite the folder's record before any check."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra = HydraConfig.get()
    out = folder / ".hydra"
    write_text(out / "config.yaml", OmegaConf.to_yaml(cfg))
    write_text(out / "hydra.yaml", OmegaConf.to_yaml({"hydra": hydra}))
    write_text(out / "overrides.yaml", OmegaConf.to_yaml(hydra.overrides.task))


def claim(folder: Path, main: bool) -> None:
    """Take a job folder for this run (rank 0; other ranks write nothing there): its lock, and
    the temporary files a killed writer left removed."""
    if not main:
        return
    hold(folder)
    if stale := remove_stale(folder):
        from runner import console

        names = ", ".join(p.name for p in stale)
        console.say(f"removed what a killed run left half-written: {names}")


def current_sweep() -> str | None:
    """The id of the sweep this job runs in (its sweep folder's sweep.json), or None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return read_record(Path(HydraConfig.get().sweep.dir), SWEEP_RECORD).get("id")


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
    from runner.compare.jobs import LAUNCHER_RECORD

    return sweep in (
        read_record(folder).get("sweep"),
        read_record(folder, LAUNCHER_RECORD).get("sweep"),
    )


_started: dict[Path, str] = {}  # sweep folders this process started: their ids


def start_sweep(sweep_dir: Path, command: list[str], subdir: str) -> str:
    """At a sweep's start, before any job runs: its folder's lock (held to the end of this
    process), its jobs checked against the runs the folder holds (`check_jobs`), and its
    identity: the same command keeps the id it had (its jobs continue), another command is
    another sweep. A later round of runner.seeds=auto, in this process, is the same sweep."""
    from runner.config.commandline import expand

    sweep_dir = sweep_dir.absolute()
    if sweep_dir in _started:
        return _started[sweep_dir]
    hold(sweep_dir)
    check_jobs(sweep_dir, subdir, expand(command))
    kept = sorted(o for o in command if not rerun_key(o))
    sweep = hashlib.sha1(json.dumps(kept).encode()).hexdigest()[:12]
    record = {"id": sweep, "command": kept, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if read_record(sweep_dir, SWEEP_RECORD).get("id") != sweep:
        write_text(sweep_dir / SWEEP_RECORD, json.dumps(record, indent=1) + "\n")
    _started[sweep_dir] = sweep
    return sweep


def rerun_key(override: str) -> bool:
    key = override.lstrip("+~").partition("=")[0]
    return any(key == k or key.startswith(k + ".") for k in RERUN_KEYS)


def check_jobs(sweep_dir: Path, subdir: str, jobs: list[list[str]]) -> None:
    """Before a sweep runs anything: each of its jobs whose folder holds a run of other
    overrides (another command's job, where this one would resume it or read it back under its
    own label) refused, in one line naming the key and both values. `subdir`: the job folders'
    name, hydra.sweep.subdir, unresolved (${hydra.job.num} in it); any other interpolation
    there is left to each job's own check (`admit`)."""
    template = subdir.replace("${hydra.job.num}", "{num}")
    if "$" in template:
        return
    refused = []
    for num, overrides in enumerate(jobs):
        folder = sweep_dir / template.format(num=num)
        ran_file = folder / ".hydra" / "overrides.yaml"
        if not (ran_file.exists() and holds_run(folder)):
            continue
        ran, asks = _values(OmegaConf.load(ran_file)), _values(overrides)
        changed = [
            f"{key}={asks.get(key, '(unset)')} (it ran: {ran.get(key, '(unset)')})"
            for key in sorted(ran.keys() | asks.keys())
            if ran.get(key) != asks.get(key) and not rerun_key(key)
        ]
        if changed:
            refused.append(f"job {num} ({folder}) asks {', '.join(changed)}")
    if refused:
        n = len(refused) - 1
        more = f"; {n} more job{'s' if n > 1 else ''} too" if n else ""
        raise UserError(
            f"{sweep_dir} holds another sweep's runs: {refused[0]}{more}: give this sweep a "
            "folder of its own (hydra.sweep.dir=...), or run the command that made it"
        )


def _values(overrides) -> dict[str, str]:
    """key -> value of a job's overrides (`+k=v`, `++k=v` as `k`)."""
    pairs = (str(o).lstrip("+~").partition("=") for o in overrides)
    return {key: value for key, _, value in pairs}
