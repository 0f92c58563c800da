"""A finished run rerun (trainer.resume): refused where the command asks for values it did not
run (its checkpoint's config, against the command's, flattened by runner/tracking.py)."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from runner.errors import UserError
from runner.tracking import flat_config

# What a rerun of a finished run may change without changing what it ran: how it is resumed,
# how long (trainer.max_steps at or below its step is what makes it finished), shown and logged.
RERUN_KEYS = (
    "trainer.resume",
    "trainer.resume_across_precision",
    "trainer.max_steps",
    "trainer.progress_bar",
    "logger",
    "runner.summary",
    "compare",
    "cache_dir",
)


def unapplied(saved: dict | None, cfg: DictConfig) -> list[str]:
    """The values of `cfg` that differ from `saved`, the config a finished run's checkpoint
    holds, as "key=new (it ran: old)"; RERUN_KEYS left out. [] where the checkpoint has none."""
    if not isinstance(saved, dict):
        return []
    before, now = flat_config(saved), flat_config(OmegaConf.to_container(cfg, resolve=True))
    return [
        f"{key}={json.loads(now.get(key, 'null'))} (it ran: {json.loads(before.get(key, 'null'))})"
        for key in sorted(before.keys() | now.keys())
        if before.get(key) != now.get(key)
        and not any(key == k or key.startswith(k + ".") for k in RERUN_KEYS)
    ]


def require_unchanged(path: Path, state: dict, cfg: DictConfig) -> None:
    """A finished run rerun (trainer.resume) with values it did not run is refused, as a resumed
    unfinished run refuses a model or precision its checkpoint does not fit: none of them would
    apply, and its summary.json would stand for a run the command did not ask for."""
    changed = unapplied(state.get("config"), cfg)
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise UserError(
            f"{path} is at step {state['step']}: the run had finished, so {', '.join(changed[:3])}"
            f"{more} would not apply: give the new run a folder of its own (hydra.run.dir=...), "
            "or rerun without them for its summary"
        )
