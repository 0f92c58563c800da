"""A job folder is one run: one config, one writer at a time, one W&B run (a sweep folder is one
sweep: runner/sweep_folder.py). Everything that reads a folder later (a rerun, the
comparison, W&B) relies on this.

Files: `.lock` (held while a process writes the folder; it names that process) and `run.json`
(the run's resolved config, its sweep and its W&B run id, written when the run starts, before
anything else, once the command's values are held against the run the folder holds)."""

from __future__ import annotations

import fcntl
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
from runner.train.resume_check import (
    RECIPE_DIGEST,
    RERUN_KEYS,
    recipe_digest,
    recipe_edited,
    unapplied,
)

LOCK, RUN_RECORD, SWEEP_RECORD = ".lock", "run.json", "sweep.json"
# Beside a job's run, how its launcher saw it end (runner/launch/jobs.py): its state (COMPLETED,
# or SLURM's CANCELLED, TIMEOUT, ...) and why, which say why a run that did not complete stopped.
LAUNCHER_RECORD = "launcher.json"
_held: dict[Path, int] = {}  # folder -> the descriptor whose flock this process holds


class Taken(UserError):
    """The folder is not this command's to write: another process writes it (`Busy`), or it
    holds a run of other values (`Changed`)."""


class Busy(Taken):
    """Another process writes the folder."""


class Changed(Taken):
    """The folder holds a run of other values."""


REFUSED = ".refused"  # in a sweep folder: its jobs refused by their folders, one file each


def _refused(error: Taken) -> Taken:
    """A job of a sweep refused its folder: recorded in the sweep folder (`.refused/`), whose
    end says so and exits 2, whatever launcher ran the job."""
    sweep = _sweep_dir()
    if sweep is not None:
        from hydra.core.hydra_config import HydraConfig

        write_text(sweep / REFUSED / f"{HydraConfig.get().job.num}.txt", f"{error}\n")
    return error


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
    except OSError as e:  # a file system without locks (some network mounts): said, not fatal
        from runner import console

        console.say(
            f"[yellow]warning:[/] {folder}: no lock here ({e.strerror}): one command at a time"
        )
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


def admit(folder: Path, cfg: DictConfig, resume: tuple | None, finished: bool, ranks) -> str:
    """Before anything in `folder` is written: refuse a command whose values are not those of
    the run the folder holds (one line naming each key and both values), then record this run
    (.hydra/, run.json) with its sweep and W&B run id; the id. `resume`: the checkpoint to resume
    from, (path, state); `finished`: the run had reached its max_steps."""
    record = read_record(folder)
    state = resume[1] if resume else None
    own = resume is not None and folder.absolute() in Path(resume[0]).absolute().parents
    if holds_run(folder):
        saved = record.get("config") or (state.get("config") if own else None)
        converts = cfg.trainer.resume_across_precision and not finished  # a finished run: never
        free = ("precision",) if converts else ()
        changed = unapplied(saved, cfg, free) + recipe_edited(record, cfg, free)
        if _global_batch(saved, record) == cfg.dataset.batch_size * ranks.world:
            # another number of ranks with the same global batch: the same run (a sharded
            # checkpoint reshards, a single file is dealt out: docs/reliability.md)
            changed = [c for c in changed if not c.startswith("dataset.batch_size=")]
        if not finished:
            changed += _schedule_change(saved, cfg, state["step"] if state else 0)
        if changed:
            raise _refused(Changed(_refusal(folder, resume, finished, changed)))
    run_id = record.get("wandb_run_id") or (state.get("wandb_run_id") if own else None)
    run_id = run_id or new_run_id()
    # the sweep it runs in; a run of its own in a sweep's job folder leaves it the sweep's
    mine = {"sweep": current_sweep() or record.get("sweep"), "wandb_run_id": run_id}
    main = ranks.main
    if main and finished:  # nothing runs: its record stands, only its sweep is noted
        write_text(folder / RUN_RECORD, json.dumps(record | mine, indent=1) + "\n")
    elif main:
        (folder / LAUNCHER_RECORD).unlink(missing_ok=True)  # an earlier attempt's end: stale
        write_hydra_files(folder, cfg)
        mine |= {"config": OmegaConf.to_container(cfg, resolve=True), "world_size": ranks.world}
        mine[RECIPE_DIGEST] = recipe_digest(cfg)
        write_text(folder / RUN_RECORD, json.dumps(record | mine, indent=1) + "\n")
    return run_id


def _global_batch(saved: dict | None, record: dict) -> int | None:
    """The global batch the folder's run trained with: its per-rank batch times its ranks."""
    batch = (saved or {}).get("dataset", {}).get("batch_size")
    return batch * record.get("world_size", 1) if isinstance(batch, int) else None


def _schedule_change(saved: dict | None, cfg: DictConfig, step: int) -> list[str]:
    """trainer.max_steps may change on a rerun only where the `step` steps taken ran the learning
    rates the new one gives (a constant schedule, or steps still in the warm-up) and none is
    past it: the continued run is then the run it says it is."""
    before, now = (saved or {}).get("trainer", {}).get("max_steps"), cfg.trainer.max_steps
    if before is None or before == now or not step:
        return []
    schedule = (saved or {}).get("optim", {}).get("scheduler") or {}
    decays = schedule.get("decay", "constant") != "constant"
    if now < step:
        why = f"it has taken {step} steps"
    elif decays and step > schedule.get("warmup_steps", 0):
        why = f"the {step} steps taken had the learning rates of a {before}-step schedule"
    else:
        return []
    return [f"trainer.max_steps={now} (it ran: {before}; {why})"]


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


def write_hydra_files(folder: Path, cfg: DictConfig) -> None:
    """.hydra/ as Hydra writes it (config.yaml, hydra.yaml, overrides.yaml), written here only
    once the command is admitted (or by a command that writes no run: runner.recipe): Hydra's
    own writing is off (conf/config.yaml sets hydra.output_subdir to null), as it would rewrite
    the folder's record before any check."""
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
    try:
        hold(folder)
    except Busy as e:
        raise _refused(e) from None
    if stale := remove_stale(folder):
        from runner import console

        names = ", ".join(p.name for p in stale)
        console.say(f"removed what a killed run left half-written: {names}")


def _sweep_dir() -> Path | None:
    """The sweep folder of the job this process runs, or None outside a sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return Path(HydraConfig.get().sweep.dir)


def current_sweep() -> str | None:
    """The id of the sweep this job runs in (its sweep folder's sweep.json), or None."""
    sweep = _sweep_dir()
    return sweep_id(sweep) if sweep else None


def sweep_id(sweep_dir: Path) -> str | None:
    """The id of the sweep `sweep_dir` holds (its sweep.json), or None."""
    return read_record(sweep_dir, SWEEP_RECORD).get("id")


def rerun_key(override: str) -> bool:
    key = override.lstrip("+~").partition("=")[0]
    return any(key == k or key.startswith(k + ".") for k in RERUN_KEYS)
