"""Saving and resuming: atomic writes, loads that never run pickled code, RNG states, and finding
the checkpoint to resume from."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from runner import console
from runner.errors import TrainingStopped, UserError, first_line
from runner.files import replacing
from runner.precision import autopilot
from runner.precision.fp4 import Recipe
from runner.train import distributed, sharded
from runner.train.convert import convert_precision
from runner.train.distributed import Dist
from runner.train.module_state import first_nonfinite, load_modules, module_states
from runner.train.rng import restore_rng, rng_states

STEP_FILE = re.compile(r"step-(\d+)\.pt")
# A sharded checkpoint (FSDP) is a folder, a set: step-N when a step checkpoint, else last-N.
SET_DIR = re.compile(r"(step|last)-(\d+)")


def save(path: Path, state: dict) -> None:
    """Written whole or not at all, fsynced (runner/files.py): a reader (or a resume after a
    crash) sees the previous checkpoint or the new one, never half of one."""
    try:
        with replacing(path, "wb", durable=True) as f:
            torch.save(state, f)
    except OSError as e:
        raise UserError(
            f"cannot write checkpoint {path}: {e.strerror or e}; the previous checkpoint is intact"
        ) from None


def load(path: Path) -> dict:
    """`weights_only=True`: tensors, numbers, strings and containers only; a pickled payload is
    refused, never run. A sharded set (a folder): its `state.pt` once its metadata, read as
    safely, says the set is whole; the model and optimizer stay on disk until the run is built
    (`"set"`: the folder they are read from)."""
    if path.is_dir():
        sharded.read_metadata(path)
        return _read(path / "state.pt", {"step"}) | {"set": path}
    return _read(path, {"model", "optimizer", "step"})


def _read(path: Path, keys: set[str]) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"checkpoint not found: {path}") from None
    except Exception as e:  # a truncated zip, or a payload weights_only refuses
        raise UserError(f"checkpoint {path} cannot be loaded safely: {first_line(e)}") from None
    if not isinstance(state, dict) or not keys <= state.keys():
        raise UserError(f"checkpoint {path} is not an amp-runner checkpoint")
    return state


def prune(folder: Path, keep: int) -> None:
    """Keep the newest `keep` step-N.pt files."""
    steps = sorted(
        (int(m.group(1)), p) for p in folder.glob("step-*.pt") if (m := STEP_FILE.fullmatch(p.name))
    )
    for _, path in steps[:-keep]:
        path.unlink(missing_ok=True)


def discard(path: Path) -> None:
    """Delete a sharded set, its commit first: a crash midway leaves an incomplete set, never one
    that looks whole with shards missing."""
    (path / sharded.COMMIT).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def prune_sets(folder: Path, keep: int, newest: Path) -> None:
    """Once `newest` is whole: it and the newest `keep` whole step-N sets stay; older last-N sets
    and sets whose save never finished (a killed run's) go."""
    sets = sorted(
        (int(m.group(2)), m.group(1), p)
        for p in folder.iterdir()
        if p.is_dir() and (m := SET_DIR.fullmatch(p.name))
    )
    steps = [p for _, kind, p in sets if kind == "step" and (p / sharded.COMMIT).exists()]
    kept = {newest, *steps[-keep:]}
    for _, _, path in sets:
        if path not in kept:
            discard(path)


def find_resume(spec: str | None, run_dir: Path) -> tuple[Path, dict] | None:
    """`auto`: the newest checkpoint in the run directory that loads (a damaged one is skipped
    with a warning), or None for a fresh start. A path: that checkpoint, or an error."""
    if not spec:
        return None
    if spec != "auto":
        path = Path(spec).expanduser()
        return path, load(path)
    # Newest first by name alone, so that only one checkpoint is read when it is good
    # (checkpoints can be gigabytes): last.pt, then step-N.pt and the sharded sets (step-N/,
    # last-N/) by N descending.
    folder = run_dir / "checkpoints"
    steps = sorted(
        (
            (int(m.group(m.lastindex)), p)
            for p in folder.glob("*-*")
            if (m := STEP_FILE.fullmatch(p.name) or (p.is_dir() and SET_DIR.fullmatch(p.name)))
        ),
        reverse=True,
    )
    last = [folder / "last.pt"] if (folder / "last.pt").exists() else []
    found = _first_loading(last + [p for _, p in steps])
    if found and found[0] in last:
        # The trainer writes step-N.pt before last.pt, so a crash between the two leaves a step
        # file newer than last.pt that the name order alone would miss: only then a second read.
        return _first_loading([p for n, p in steps if n > found[1]["step"]]) or found
    return found


def _first_loading(paths: list[Path]) -> tuple[Path, dict] | None:
    """The first of `paths` that loads, warning about the ones that do not."""
    for path in paths:
        try:
            return path, load(path)
        except UserError as e:
            console.say(f"[yellow]warning:[/] skipping {path.name}: {e}")
    return None


class Checkpointer:
    """Writes a run's checkpoints into `out_dir/checkpoints`: `last.pt`, and `step-N.pt` when asked (the
    newest `keep_last_k` kept); rank 0 alone writes. Under FSDP each checkpoint is a sharded set
    instead (a folder, `step-N/` or `last-N/`) that every rank writes into."""

    def __init__(self, out_dir: Path, dist: Dist, sharded: bool, keep_last_k: int):
        self.folder, self.dist = out_dir / "checkpoints", dist
        self.sharded, self.keep_last_k = sharded, keep_last_k

    def save(self, state: dict, step: int, step_file: bool, tensors) -> None:
        """`tensors`: (name, tensor) pairs of the state that must be finite to be saved."""
        if bad := self._nonfinite(tensors):
            raise TrainingStopped(
                f"refusing to checkpoint non-finite state at step {step}: {bad} holds inf/NaN"
            )
        if self.sharded:
            self._save_set(state, f"{'step' if step_file else 'last'}-{step}")
            return
        names = ([f"step-{step}.pt"] if step_file else []) + ["last.pt"]
        if not self.dist.main:
            return
        for name in names:
            save(self.folder / name, state)
        if step_file:
            prune(self.folder, self.keep_last_k)

    def _save_set(self, state: dict, name: str) -> None:
        """A new folder for each checkpoint, so the previous one is never written over: rank 0
        clears a leftover of the same name (a killed run's) and writes all but the model and
        optimizer (`state.pt`), then every rank writes its shards and DCP commits the set last."""
        path = self.folder / name
        modules = {key: state.pop(key) for key in ("model", "optimizer")}
        if self.dist.main:
            discard(path)
            save(path / "state.pt", state | {"shards": self.dist.world})
        distributed.barrier(self.dist)
        sharded.save(path, modules, self.dist.enabled)
        if self.dist.main:
            prune_sets(self.folder, self.keep_last_k, path)

    def _nonfinite(self, tensors) -> str | None:
        """The first non-finite tensor's name, the same verdict on every rank: rank 0's under DDP
        (its copy is saved; the others' BatchNorm statistics are their own), any rank's when
        sharded."""
        bad = first_nonfinite(tensors)
        if not self.dist.enabled:
            return bad
        verdicts = distributed.gather(bad, self.dist)
        return next(filter(None, verdicts), None) if self.sharded else verdicts[0]

    def state(self, trainer) -> dict:
        """A trainer's whole state: modules, precision (scaler, master weights), position,
        counters, every rank's RNG (and nvfp4's stochastic rounding generators), and what the
        run adds (config, W&B run id)."""
        return {
            **module_states(trainer.task, trainer.optimizers, trainer.schedulers, self.sharded),
            **trainer.precision.state_dict(),
            "step": trainer.step,
            "samples_seen": trainer.samples_seen,
            "skipped_steps": trainer.skipped_steps,
            "consecutive_skipped": trainer.consecutive_skipped,
            "precision": trainer.precision.name,
            "autopilot": autopilot.state(trainer.precision.autopilot),  # its switches, measures
            **rng_states(self.dist, _streams(trainer)),
            **trainer.extra_state,
        }

    def restore(self, trainer, state: dict) -> None:
        load_modules(state, trainer.task, trainer.optimizers, trainer.schedulers, self.sharded)
        allowed = trainer.cfg.resume_across_precision
        trainer.conversion = convert_precision(state, trainer.task, trainer.precision, allowed)
        trainer.step, trainer.samples_seen = state["step"], state["samples_seen"]
        trainer.precision.at_step(trainer.step)  # a staged run resumes in its stage
        trainer.precision.load_state_dict(state)
        autopilot.resume(trainer.precision.autopilot, state.get("autopilot"))
        trainer.skipped_steps = state.get("skipped_steps", 0)
        trainer.consecutive_skipped = state.get("consecutive_skipped", 0)
        streams = restore_rng(state, self.dist)
        if (recipe := _fp4_recipe(trainer)) is None:
            return
        if streams is None and recipe.sr:
            console.say(
                "[yellow]warning:[/] the checkpoint holds no stochastic rounding state (written "
                "before it was saved): precision.fp4.sr's stream restarts from its seed, so the "
                "run will not continue bit for bit"
            )
        recipe.load_sr_state((streams or {}).get("fp4_sr", {}))


def _fp4_recipe(trainer) -> Recipe | None:
    """nvfp4's or mxfp4's recipe (its stochastic rounding generators), None in other modes."""
    recipe = getattr(trainer.precision.converted, "recipe", None)
    return recipe if isinstance(recipe, Recipe) else None


def _streams(trainer) -> dict:
    """This rank's generators beyond the global ones, for the checkpoint (runner/train/rng.py)."""
    recipe = _fp4_recipe(trainer)
    return {"fp4_sr": recipe.sr_state()} if recipe else {}
