"""Checks a command line before Hydra runs it, so that bad input costs one clear line and no
traceback, and a sweep with a typo in its fifth job fails before the first one starts."""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

from runner.errors import UserError, clip, first_line

# Hydra flags after which we do not second-guess the command line.
_HYDRA_INFO_FLAGS = (
    "--help",
    "-h",
    "--hydra-help",
    "--cfg",
    "-c",
    "--info",
    "-i",
    "--shell-completion",
    "-sc",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
)
MAX_PREFLIGHT_JOBS = 64


def _one_line(e: BaseException) -> str:
    parts = []
    while e is not None and len(parts) < 3:
        text = str(e).strip()
        if text:
            parts.append(text.splitlines()[0].rstrip("."))
        e = e.__cause__
    line = ": ".join(dict.fromkeys(parts)) or "invalid configuration"
    return line + _allowed(line)


def _allowed(message: str) -> str:
    """What a message about an unknown key or an unreadable value leaves out: the keys allowed
    there (from the runner's schemas), or how to quote a value."""
    from dataclasses import fields

    from omegaconf import OmegaConf

    from runner import config

    if "LexerNoViableAltException" in message:
        return " (quote a value with spaces or other characters: 'key=\"value\"')"
    keys = None
    if found := re.search(r"Key '\w+' not in '(\w+)'", message):
        schema = getattr(config, found[1], None)
        keys = [f.name for f in fields(schema)] if schema is not None else None
    elif (found := re.search(r"override '([\w.]+)'", message)) and "not in struct" in message:
        parent = found[1].rpartition(".")[0]
        node = OmegaConf.select(OmegaConf.structured(config.Config), parent) if parent else None
        keys = list(node) if OmegaConf.is_dict(node) else None
    return f" (allowed: {', '.join(keys)})" if keys else ""


def _parse(args: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(
        [a for a in args if not a.startswith("-") and not a.startswith(("hydra.", "hydra/"))]
    )


def is_multirun(args: list[str]) -> bool:
    """`-m`, `hydra.mode=MULTIRUN`, or an experiment that is a sweep by itself (amp_check)."""
    if "-m" in args or "--multirun" in args or "hydra.mode=MULTIRUN" in args:
        return True
    from omegaconf import OmegaConf

    from runner import CONF_DIR

    for arg in args:
        key, _, name = arg.lstrip("+").partition("=")
        path = CONF_DIR / "experiment" / f"{name}.yaml"
        if key == "experiment" and path.is_file():
            if OmegaConf.select(OmegaConf.load(path), "hydra.mode") == "MULTIRUN":
                return True
    return False


def with_seeds(args: list[str]) -> list[str]:
    """The command line with `runner.seeds=N` (N > 1) as a seed sweep, `seed=S,S+1,...,S+N-1`
    from the `seed=S` given (else 0): every job of the multirun then runs once per seed.
    Raises UserError for a single run, or next to a seed sweep."""
    if informational(args):
        return args
    try:
        overrides = {o.get_key_element().lstrip("+~"): o for o in _parse(args)}
    except Exception as e:
        raise UserError(f"cannot parse the command line: {_one_line(e)}") from None
    option = overrides.get("runner.seeds")
    if option is not None and option.is_sweep_override():
        raise UserError(f"{option.input_line} is invalid: one number, not a sweep")
    n = option.value() if option is not None else 1
    if not isinstance(n, int) or isinstance(n, bool) or n <= 1:
        return args  # 1, or a bad value that composing and validating report
    if not is_multirun(args):
        raise UserError(
            f"runner.seeds={n} repeats the jobs of a sweep: add -m "
            f"(python -m runner -m runner.seeds={n} ...), or set seed=... for one run"
        )
    seed = overrides.get("seed")
    if seed is not None and (seed.is_sweep_override() or not isinstance(seed.value(), int)):
        raise UserError(
            f"runner.seeds={n} and {seed.input_line} both choose the seeds: give one of them"
        )
    first = seed.value() if seed is not None else 0
    sweep = "seed=" + ",".join(str(first + i) for i in range(n))
    return [a for a in args if a != (seed.input_line if seed else None)] + [sweep]


def sweep_keys(args: list[str]) -> list[str]:
    """The keys a multirun varies, e.g. ["precision"] for `-m precision=fp32,bf16`."""
    return [o.get_key_element().lstrip("+~") for o in _parse(args) if o.is_sweep_override()]


def expand(args: list[str]) -> list[list[str]]:
    """The override lists of every job the command line describes (one for a single run)."""
    overrides = _parse(args)
    choices = []
    for o in overrides:
        if o.is_sweep_override():
            choices.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    return [list(c) for c in itertools.islice(itertools.product(*choices), MAX_PREFLIGHT_JOBS)]


def _check_group_choices(jobs: list[list[str]]) -> None:
    from runner import CONF_DIR

    groups = {
        d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in CONF_DIR.iterdir() if d.is_dir()
    }
    for job in jobs:
        for override in job:
            key, _, value = override.lstrip("+~").partition("=")
            if key in groups and value not in groups[key]:
                raise UserError(f"unknown {key} {value!r}: choose from {', '.join(groups[key])}")


def informational(args: list[str]) -> bool:
    """Hydra prints something (help, the config) instead of running."""
    return any(a.split("=")[0] in _HYDRA_INFO_FLAGS for a in args)


def preflight(args: list[str]) -> None:
    """Compose and validate every job of the command line. Raises UserError."""
    if informational(args):
        return
    from hydra import compose, initialize_config_dir

    from runner import CONF_DIR
    from runner.validation import validate

    try:
        jobs = expand(args)
    except Exception as e:
        raise UserError(f"cannot parse the command line: {_one_line(e)}") from None
    # A user's own config groups (hydra.searchpath=[pkg://mypkg.conf]) add options that only
    # composing knows of: Hydra's own message names the missing option there.
    searchpath = [a for a in args if a.startswith("hydra.searchpath=")]
    if not searchpath:
        _check_group_choices(jobs)
    _check_output_dirs(args)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for job in jobs:
            try:
                cfg = compose("config", overrides=job + searchpath)
            except Exception as e:
                raise UserError(_one_line(e)) from None
            _resolve(cfg)
            validate(cfg)
            check_buildable(cfg)


def _check_output_dirs(args: list[str]) -> None:
    """Hydra makes its output folder before any of the runner's code runs: a path through a
    file would stop it with a traceback."""
    for arg in args:
        key, _, value = arg.partition("=")
        if key not in ("hydra.run.dir", "hydra.sweep.dir") or "${" in value:
            continue
        for path in (Path(value), *Path(value).parents):
            if path.exists() and not path.is_dir():
                raise UserError(f"{key}={value} is invalid: {path} is a file, not a folder")


def _resolve(cfg) -> None:
    """Every interpolation resolved once, so that an unset variable or a missing key is one
    line naming the key here, not a traceback wherever it is first read."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:
        key = e.full_key
        raise UserError(f"{key} is required: set it on the command line ({key}=...)") from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise UserError(f"{key + ': ' if key else ''}cannot resolve it: {first_line(e)}") from None


# Keys Hydra's instantiate reads itself, and what the runner passes a task-owned group's target.
_INSTANTIATE_KEYS = {"_target_", "_recursive_", "_partial_", "_convert_", "_args_"}
_PASSED = {"model": {"data"}}


def check_buildable(cfg) -> None:
    """What can be checked of a job without training: its device exists, and each `_target_`
    of the task-owned groups imports and takes the keys its config node gives it (a typo added
    with `++` is one line here, not an error from the constructor or a key nothing reads)."""
    import inspect

    from hydra.utils import get_object
    from omegaconf import OmegaConf

    from runner.run import resolve_device

    resolve_device(cfg.trainer.device)
    for group in ("model", "dataset", "optim"):
        nodes = [(group, cfg.get(group))]
        while nodes:
            path, node = nodes.pop()
            if not OmegaConf.is_dict(node):
                continue
            nodes += [(f"{path}.{k}", v) for k, v in node.items_ex(resolve=False)]
            target = node.get("_target_")
            if not isinstance(target, str):
                continue
            try:
                built = get_object(target)
            except Exception as e:
                raise UserError(
                    f"{path}._target_={target} cannot be imported: {_one_line(e)}"
                ) from None
            try:
                params = inspect.signature(built).parameters.values()
            except (TypeError, ValueError):  # no signature to read (a builtin)
                continue
            if any(p.kind is p.VAR_KEYWORD for p in params):
                continue
            names = {p.name for p in params if p.kind is not p.VAR_POSITIONAL}
            unknown = sorted(set(node) - _INSTANTIATE_KEYS - names)
            if unknown:
                takes = ", ".join(sorted(names - _PASSED.get(path, set()) - {"self"}))
                raise UserError(
                    f"{path}.{unknown[0]} is not a key {target} takes (it takes: {takes})"
                )


def fail(error: UserError) -> None:
    """One line on stderr, then exit: 2 for bad input, 1 for a run that stopped itself."""
    print(f"error: {clip(str(error), 600)}", file=sys.stderr)
    sys.exit(getattr(error, "exit_code", 2))
