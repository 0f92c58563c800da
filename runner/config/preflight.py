"""Checks a command line before Hydra runs it, so that bad input costs one clear line and no
traceback, and a sweep with a typo in its fifth job fails before the first one starts."""

from __future__ import annotations

from pathlib import Path

from runner.config.commandline import expand, informational, one_line
from runner.config.rules import choices
from runner.errors import UserError, first_line


def _check_group_choices(jobs: list[list[str]]) -> None:
    from runner import CONF_DIR

    groups = {d.name: choices(d.name) for d in CONF_DIR.iterdir() if d.is_dir()}
    for job in jobs:
        for override in job:
            key, _, value = override.lstrip("+~").partition("=")
            if key in groups and value not in groups[key]:
                raise UserError(f"unknown {key} {value!r}: choose from {', '.join(groups[key])}")


def preflight(args: list[str]) -> None:
    """Compose and validate every job of the command line. Raises UserError."""
    if informational(args):
        return
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    from runner import CONF_DIR
    from runner.config.validation import validate

    try:
        jobs = expand(args)
    except Exception as e:
        raise UserError(f"cannot parse the command line: {one_line(e)}") from None
    # A user's own config groups (hydra.searchpath=[pkg://mypkg.conf]) add options that only
    # composing knows of: Hydra's own message names the missing option there.
    searchpath = [a for a in args if a.startswith("hydra.searchpath=")]
    if not searchpath:
        _check_group_choices(jobs)
    _check_output_dirs(args)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for job in jobs:
            try:
                cfg = compose("config", overrides=job + searchpath, return_hydra_config=True)
            except Exception as e:
                raise UserError(one_line(e)) from None
            launcher = OmegaConf.select(cfg, "hydra.launcher._target_", default="")
            with open_dict(cfg):
                del cfg["hydra"]  # the job's own config, as Hydra hands it to the job
            _resolve(cfg)
            validate(cfg)
            check_buildable(cfg, elsewhere=runs_elsewhere(launcher))


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


# Launchers whose jobs run on other machines (a SLURM node, a Ray worker), and their subclasses
# (amp-runner's, hydra_plugins/amp_runner_launcher): a job's device is checked there, by the run
# (validation checks its name here).
_ELSEWHERE = {
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
    "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher",
    "hydra_plugins.hydra_ray_launcher.ray_aws_launcher.RayAWSLauncher",
}


def runs_elsewhere(launcher_target: str) -> bool:
    """Whether the launcher named by `hydra.launcher._target_` runs jobs on other machines."""
    from hydra._internal.utils import _locate

    try:
        launcher = _locate(launcher_target)  # imported already: Hydra imports its plugins
    except Exception:
        return False
    names = {f"{c.__module__}.{c.__qualname__}" for c in getattr(launcher, "__mro__", ())}
    return bool(names & _ELSEWHERE)


def check_buildable(cfg, elsewhere: bool = False) -> None:
    """What can be checked of a job without training: its device exists (not where the job runs
    `elsewhere`, on a SLURM node or a Ray worker: a login node has no GPU, and the run checks it
    there), and each `_target_` of the task-owned groups imports and takes the keys its config
    node gives it (a typo added with `++` is one line here, not an error from the constructor or
    a key nothing reads)."""
    import inspect

    from hydra._internal.utils import _locate
    from omegaconf import OmegaConf

    from runner.precision.caps import resolve_device

    if not elsewhere:
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
            try:  # not hydra.utils.get_object: it logs Hydra's whole error chain first
                built = _locate(target)
            except Exception as e:  # the ImportError that Hydra's "Error loading ..." wraps
                raise UserError(
                    f"{path}._target_={target} cannot be imported: {first_line(e.__cause__ or e)}"
                ) from None
            try:
                params = inspect.signature(built).parameters.values()
            except (TypeError, ValueError):  # no signature to read (a builtin)
                continue
            _check_choices(path, node, built)
            if any(p.kind is p.VAR_KEYWORD for p in params):
                continue
            names = {p.name for p in params if p.kind is not p.VAR_POSITIONAL}
            unknown = sorted(set(node) - _INSTANTIATE_KEYS - names)
            if unknown:
                takes = ", ".join(sorted(names - _PASSED.get(path, set()) - {"self"}))
                raise UserError(
                    f"{path}.{unknown[0]} is not a key {target} takes (it takes: {takes})"
                )


def _check_choices(path: str, node, built) -> None:
    """A value of the node against its parameter's `Literal[...]` annotation, where the target
    has one (`activation: Literal["gelu", "fp32_softplus"]`): a task's choices are checked in
    every job of a sweep before the first trains, not when that job builds its model."""
    import inspect
    from typing import Literal, get_args, get_origin

    from runner.config.rules import require

    try:
        params = inspect.signature(built, eval_str=True).parameters.values()
    except Exception:  # an annotation that does not evaluate: the constructor checks it
        return
    for p in params:
        if get_origin(p.annotation) is Literal and p.name in node:
            value, allowed = node[p.name], get_args(p.annotation)
            require(
                value in allowed,
                f"{path}.{p.name}",
                value,
                f"allowed: {', '.join(map(str, allowed))}",
            )
