"""A run continued in its folder (trainer.resume, or a sweep run again) runs the values it ran:
the command's config against the folder's record of it (runner/folders.py), flattened by
runner/tracking.py."""

from __future__ import annotations

import hashlib
import json

from omegaconf import DictConfig, OmegaConf

from runner.tracking import flat_config

# What a rerun may change without changing what it ran: how it is resumed and checkpointed, how long
# (trainer.max_steps at or below its step is what makes it finished), shown and logged.
RERUN_KEYS = (
    "trainer.resume",
    "trainer.resume_across_precision",
    "trainer.max_steps",
    "trainer.checkpoint_every_n_steps",
    "trainer.keep_last_k",
    "trainer.strategy",  # DDP or FSDP: the same numerics (docs/distributed.md), shards apart
    "trainer.time_limit_s",  # when an attempt stops for the job's end, not what it trains
    "trainer.time_limit_margin_s",
    "trainer.progress_bar",
    "logger",
    "runner.summary",
    "runner.seeds",  # how many seeds the sweep runs, and how the comparison times and says them
    "runner.max_seeds",
    "runner.speed",
    "runner.speed_rounds",
    "runner.speed_steps",
    "compare",
    "cache_dir",
    # a resumed run takes its loss scaler's floor, cap, hysteresis and pace from its config, the
    # scale from its checkpoint (docs/answers.md)
    "precision.grad_scaler",
)


def unapplied(saved: dict | None, cfg: DictConfig, also: tuple[str, ...] = ()) -> list[str]:
    """The values of `cfg` that differ from `saved`, the config the run was started with, as
    "key=new (it ran: old)"; RERUN_KEYS and the groups in `also` (precision, where
    trainer.resume_across_precision converts the run) left out. [] where nothing was saved."""
    if not isinstance(saved, dict):
        return []
    before, now = flat_config(saved), flat_config(OmegaConf.to_container(cfg, resolve=True))
    free = (*RERUN_KEYS, *also)
    return [
        f"{key}={json.loads(now.get(key, 'null'))} (it ran: {json.loads(before.get(key, 'null'))})"
        for key in sorted(before.keys() | now.keys())
        if before.get(key) != now.get(key)
        and not any(key == k or key.startswith(k + ".") for k in free)
    ]


# run.json: the digest of the rules precision.recipe's file held when the run read it, beside its
# path in the config: a file edited in place is another run under the same path
RECIPE_DIGEST = "recipe_rules_sha256"


def recipe_digest(cfg: DictConfig) -> str | None:
    """The digest of precision.recipe's rules as its file holds them now (its YAML, parsed:
    comments and layout aside); None without a recipe."""
    from runner.precision.recipe import read

    if not cfg.precision.get("recipe"):
        return None
    rules = json.dumps(read(cfg.precision.recipe), sort_keys=True, default=str)
    return hashlib.sha256(rules.encode()).hexdigest()


def recipe_edited(record: dict, cfg: DictConfig, also: tuple[str, ...] = ()) -> list[str]:
    """precision.recipe as `unapplied` says a changed value, where its path is the one the run
    read but the file's rules are not (`record`: run.json). [] for a record from before the
    digest was kept, another path (`unapplied` names it), or precision in `also`."""
    saved = (record.get("config") or {}).get("precision") or {}
    if (
        RECIPE_DIGEST not in record
        or "precision" in also
        or saved.get("recipe") != cfg.precision.recipe
    ):
        return []
    if record[RECIPE_DIGEST] == recipe_digest(cfg):
        return []
    return [f"precision.recipe={cfg.precision.recipe} (its file's rules are not those the run ran)"]
