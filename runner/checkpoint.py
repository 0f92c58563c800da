"""Saving and resuming: atomic writes, loads that never run pickled code, RNG states, and finding
the checkpoint to resume from."""

from __future__ import annotations

import os
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from runner import console, distributed
from runner.distributed import Dist
from runner.errors import TrainingStopped, UserError, first_line

STEP_FILE = re.compile(r"step-(\d+)\.pt")


def save(path: Path, state: dict) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: a reader (or a resume
    after a crash) sees the previous checkpoint or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(
            f"cannot write checkpoint {path}: {e.strerror or e}; the previous checkpoint is intact"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)


def load(path: Path) -> dict:
    """`weights_only=True`: tensors, numbers, strings and containers only; a pickled payload is
    refused, never run."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"checkpoint not found: {path}") from None
    except Exception as e:  # a truncated zip, or a payload weights_only refuses
        raise UserError(f"checkpoint {path} cannot be loaded safely: {first_line(e)}") from None
    if not isinstance(state, dict) or not {"model", "optimizer", "step"} <= state.keys():
        raise UserError(f"checkpoint {path} is not an amp-runner checkpoint")
    return state


def prune(folder: Path, keep: int) -> None:
    """Keep the newest `keep` step-N.pt files (and their shards)."""
    steps = sorted(
        (int(m.group(1)), p) for p in folder.glob("step-*.pt") if (m := STEP_FILE.fullmatch(p.name))
    )
    for _, path in steps[:-keep]:
        for shard in folder.glob(f"{path.stem}.shard*.pt"):
            shard.unlink(missing_ok=True)
        path.unlink(missing_ok=True)


def shard_path(path: Path, rank: int) -> Path:
    """Rank r's file of a sharded checkpoint (trainer.strategy=fsdp): last.shard1.pt, ..."""
    return path if rank == 0 else path.with_name(f"{path.stem}.shard{rank}.pt")


def own_shard(path: Path, state: dict, rank: int, world: int) -> dict:
    """This rank's part of the checkpoint at `path`: the file itself unless it is sharded."""
    shards = state.get("shards")
    if not shards:
        return state
    if shards != world:
        raise UserError(
            f"checkpoint {path} is sharded over {shards} ranks: resume it with {shards} "
            f"(this run has {world})"
        )
    own = load(shard_path(path, rank)) if rank else state
    if own["step"] != state["step"]:
        raise UserError(
            f"checkpoint {path}: rank {rank}'s shard is from step {own['step']}, not {state['step']}"
        )
    return own


def find_resume(spec: str | None, run_dir: Path) -> tuple[Path, dict] | None:
    """`auto`: the newest checkpoint in the run directory that loads (a damaged one is skipped
    with a warning), or None for a fresh start. A path: that checkpoint, or an error."""
    if not spec:
        return None
    if spec != "auto":
        path = Path(spec).expanduser()
        return path, load(path)
    # Newest first by file name alone, so that only one checkpoint is read when it is good
    # (checkpoints can be gigabytes): last.pt, then step-N.pt by N descending. Shards
    # (*.shardK.pt) match neither pattern and are read through their rank-0 file.
    folder = run_dir / "checkpoints"
    steps = sorted(
        (
            (int(m.group(1)), p)
            for p in folder.glob("step-*.pt")
            if (m := STEP_FILE.fullmatch(p.name))
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


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """Writes a run's checkpoints into `out_dir/checkpoints`: `last.pt`, and `step-N.pt` when asked (the
    newest `keep_last_k` kept). Under FSDP every rank writes its shard, then rank 0 its file,
    which names how many there are; otherwise rank 0 alone writes."""

    def __init__(self, out_dir: Path, dist: Dist, sharded: bool, keep_last_k: int):
        self.folder, self.dist = out_dir / "checkpoints", dist
        self.sharded, self.keep_last_k = sharded, keep_last_k

    def save(self, state: dict, step: int, step_file: bool, tensors) -> None:
        """`tensors`: (name, tensor) pairs of the state that must be finite to be saved."""
        if bad := self._nonfinite(tensors):
            raise TrainingStopped(
                f"refusing to checkpoint non-finite state at step {step}: {bad} holds inf/NaN"
            )
        names = ([f"step-{step}.pt"] if step_file else []) + ["last.pt"]
        if self.sharded:
            state["shards"] = self.dist.world
            if not self.dist.main:
                for name in names:
                    save(shard_path(self.folder / name, self.dist.rank), state)
            distributed.barrier(self.dist)
        if not self.dist.main:
            return
        for name in names:
            save(self.folder / name, state)
        if step_file:
            prune(self.folder, self.keep_last_k)

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
        counters, every rank's RNG, and what the run adds (config, W&B run id)."""
        return {
            **module_states(trainer.task, trainer.optimizers, trainer.schedulers),
            **trainer.precision.state_dict(),
            "step": trainer.step,
            "samples_seen": trainer.samples_seen,
            "skipped_steps": trainer.skipped_steps,
            "consecutive_skipped": trainer.consecutive_skipped,
            "precision": trainer.precision.name,
            **rng_states(self.dist),
            **trainer.extra_state,
        }

    def restore(self, trainer, state: dict) -> None:
        load_modules(state, trainer.task, trainer.optimizers, trainer.schedulers)
        allowed = trainer.cfg.resume_across_precision
        trainer.conversion = convert_precision(state, trainer.task, trainer.precision, allowed)
        trainer.step, trainer.samples_seen = state["step"], state["samples_seen"]
        trainer.precision.at_step(trainer.step)  # a staged run resumes in its stage
        trainer.precision.load_state_dict(state)
        trainer.skipped_steps = state.get("skipped_steps", 0)
        trainer.consecutive_skipped = state.get("consecutive_skipped", 0)
        restore_rng(state, self.dist)


def first_nonfinite(tensors) -> str | None:
    """The name of the first floating tensor of (name, tensor) pairs that holds inf or NaN."""
    return next(
        (name for name, t in tensors if t.is_floating_point() and not torch.isfinite(t).all()),
        None,
    )


def convert_precision(state: dict, task: torch.nn.Module, precision, allowed: bool) -> dict | None:
    """After the modules are loaded: a checkpoint written under another precision mode is
    refused, or with `allowed` (trainer.resume_across_precision) converted for this run's mode;
    returns what changed ({from, to, changes}, also said on the console), None for the same mode.
    fp16_master's fp32 masters go into the weights, not their fp16 copies; this run's masters are
    made from the checkpoint's weights; its GradScaler is dropped where this mode scales no loss."""
    saved, mode = state.get("precision"), precision.name
    if saved is None or saved == mode:
        return None
    if not allowed:
        raise UserError(
            f"the checkpoint was written under precision={saved}, this run is precision={mode}: "
            f"resume with precision={saved}, or set trainer.resume_across_precision=true to "
            "convert it"
        )
    # A sharded set (FSDP) loads through DCP, in this run's dtypes: it has no "model" to read.
    model, params, changes = state.get("model", {}), dict(task.named_parameters()), []
    masters, owners = state.get("master_weights") or [], []
    if masters and not precision.master:
        # fp16_master keeps a master for each trainable weight it cast to fp16, in model order
        owners = [n for n, p in params.items() if p.requires_grad and model[n].dtype == torch.half]
        if [model[n].shape for n in owners] != [m.shape for m in masters]:
            raise UserError(
                f"the precision={saved} checkpoint's fp32 master weights do not fit this model"
            )
        with torch.no_grad():
            for name, master in zip(owners, masters, strict=True):
                params[name].copy_(master)
        changes.append(f"its fp32 master weights ({len(masters)}) loaded, not their fp16 copies")
    elif precision.master and not masters:
        names = {p: n for n, p in params.items()}
        state["master_weights"] = [model[names[p]].float() for p in precision.master.masters]
        changes.append("fp32 master weights made from its weights")
    current = task.state_dict()
    casts = Counter(
        (_dtype(value), _dtype(current[key]))
        for key, value in model.items()
        if key not in owners and value.is_floating_point() and value.dtype != current[key].dtype
    )
    changes += [f"{n} tensors from {a} to {b}" for (a, b), n in casts.items()]
    scaler, keeps_scaler = state.get("scaler"), precision.state_dict()["scaler"] is not None
    if scaler and not keeps_scaler:
        changes.append(f"its GradScaler (scale {scaler['scale']:g}) dropped: {mode} scales no loss")
    elif keeps_scaler and not scaler:
        changes.append("the GradScaler starts at precision.grad_scaler.init_scale")
    console.say(f"resuming a precision={saved} checkpoint as {mode}: {'; '.join(changes)}")
    return {"from": saved, "to": mode, "changes": changes}


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _by_group(objects: dict) -> dict:
    """One optimizer (or schedule): its state dict. Several (a GAN): a dict of them by group."""
    states = {name: obj.state_dict() for name, obj in objects.items()}
    return next(iter(states.values())) if len(states) == 1 else states


def module_states(task: torch.nn.Module, optimizers: dict, schedulers: dict) -> dict:
    return {
        "model": task.state_dict(),
        "optimizer": _by_group(optimizers),
        "scheduler": _by_group(schedulers),
    }


def load_modules(state: dict, task: torch.nn.Module, optimizers: dict, schedulers: dict) -> None:
    """The model, optimizers and schedules from a checkpoint; a mismatch is one clear error."""
    try:
        task.load_state_dict(state["model"])
    except RuntimeError as e:
        mismatch = next(
            (
                line.strip()
                for line in str(e).splitlines()
                if "size mismatch" in line or "Missing" in line or "Unexpected" in line
            ),
            first_line(e),
        )
        raise UserError(f"the checkpoint does not fit this model config: {mismatch}") from None
    for key, objects in (("optimizer", optimizers), ("scheduler", schedulers)):
        saved = state[key] if len(objects) > 1 else {next(iter(objects)): state[key]}
        if set(saved) != set(objects):
            raise UserError(f"the checkpoint's {key}s ({', '.join(saved)}) do not fit this task")
        for name, obj in objects.items():
            obj.load_state_dict(saved[name])


def rng_states(dist: Dist) -> dict:
    """This process's RNG states, and with several ranks every rank's (dropout differs by rank),
    gathered for rank 0 to save. Every rank must call it."""
    states = distributed.gather(rng_state(), dist)
    return {"rng": states[dist.rank], **({"rng_by_rank": states} if dist.enabled else {})}


def restore_rng(state: dict, dist: Dist) -> None:
    by_rank = state.get("rng_by_rank") or []
    if dist.enabled and len(by_rank) != dist.world:
        console.say(
            f"[yellow]warning:[/] the checkpoint was written by {len(by_rank) or 1} rank(s), "
            f"this run has {dist.world}: dropout's random stream will differ"
        )
    set_rng_state(by_rank[dist.rank] if len(by_rank) == dist.world else state["rng"])
