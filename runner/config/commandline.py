"""The command line as Hydra will read it: its overrides parsed, the jobs of a sweep listed,
`runner.seeds=N` turned into a seed sweep, and a parse error said in one line."""

from __future__ import annotations

import itertools
import re

from runner.config.schema import AUTO_SEEDS
from runner.errors import UserError

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
ROUND = "seed{seed}-"  # a runner.seeds=auto round's job folders: seed<S>-<job number>, seed<S>-<block>-<job number> where a round has several


def one_line(e: BaseException) -> str:
    if typed := _mistyped(e):
        return typed
    parts = []
    while e is not None and len(parts) < 3:
        text = str(e).strip()
        if text:
            parts.append(text.splitlines()[0].rstrip("."))
        e = e.__cause__
    line = ": ".join(dict.fromkeys(parts)) or "invalid configuration"
    return line + _allowed(line)


# what a schema's type allows, by the name OmegaConf's validation error gives it
_TYPES = {"bool": "true or false", "integer": "an integer", "float": "a number"}


def _mistyped(e: BaseException) -> str | None:
    """Hydra's "Error merging override k=v" for a value its schema field cannot take, said as
    the runner's other lines are: "k=v is invalid: must be true or false"."""
    override = re.match(r"Error merging override ([^=\s]+)=(.*)", str(e).strip())
    cause = re.search(r"not a valid (\w+)|could not be converted to (\w+)", str(e.__cause__))
    if override is None or cause is None:
        return None
    allowed = _TYPES.get((cause[1] or cause[2]).lower())
    return f"{override[1]}={override[2]} is invalid: must be {allowed}" if allowed else None


def _allowed(message: str) -> str:
    """What a message about an unknown key or an unreadable value leaves out: the keys allowed
    there (from the runner's schemas), or how to quote a value."""
    from dataclasses import fields

    from omegaconf import OmegaConf

    from runner.config import schema as config

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


# Command-line keys that stand for another: precision.autopilot=true is the switch of the
# autopilot whose settings sit under the same key (precision.autopilot.every_n_steps=...)
ALIASES = {"precision.autopilot": "precision.autopilot.enabled"}


def with_aliases(args: list[str]) -> list[str]:
    """The command line with each alias's key (`ALIASES`) written as the key it stands for."""
    out = []
    for arg in args:
        prefix, key, rest = re.match(r"^([+~]*)([^=]*)(.*)$", arg).groups()
        out.append(prefix + ALIASES.get(key, key) + rest if rest.startswith("=") else arg)
    return out


def normalized(args: list[str]) -> list[str]:
    """The command line as the runner composes it: each alias's key written out (`ALIASES`),
    then runner.seeds=N as a seed sweep (`with_seeds`)."""
    return with_seeds(with_aliases(args))


def with_seeds(args: list[str]) -> list[str]:
    """The command line with `runner.seeds=N` (N > 1) as a seed sweep, `seed=S,S+1,...,S+N-1`
    from the `seed=S` given (else 0): every job of the multirun then runs once per seed;
    `runner.seeds=auto` starts with AUTO_SEEDS of them (runner/compare/seeds.py adds more).
    Raises UserError for a single run, or next to a seed sweep."""
    if informational(args):
        return args
    try:
        overrides = {o.get_key_element().lstrip("+~"): o for o in _parse(args)}
    except Exception as e:
        raise UserError(f"cannot parse the command line: {one_line(e)}") from None
    option = overrides.get("runner.seeds")
    if option is not None and option.is_sweep_override():
        raise UserError(f"{option.input_line} is invalid: one number, not a sweep")
    n = option.value() if option is not None else 1
    n = AUTO_SEEDS if n == "auto" else n
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


def seed_round(args: list[str], seed: int, blocks: list, sweep_dir: str) -> list[list[str]]:
    """The next round of a `runner.seeds=auto` sweep (runner/compare/seeds.py's next_round):
    a command line a block, each the command with one seed, `seed`, each key it sweeps
    narrowed to the block's values and each key the config's hydra.sweeper.params sweeps set
    to them, in the same sweep folder, in job folders of the block's name (seed<S>-...): the
    lines' cross products are the round's jobs, no other."""
    lines = []
    for name, values in blocks:
        given = {key.lstrip("+~"): f"{key}={','.join(v)}" for key, v in values.items()}
        line = []
        for arg in args:
            key = arg.lstrip("+~").partition("=")[0]
            if key in ("seed", "hydra.sweep.dir", "hydra.sweep.subdir"):
                continue
            ours = given.pop(key, None)
            swept = ours and not arg.startswith("-") and _parse([arg])[0].is_sweep_override()
            line.append(ours if swept else arg)
        line += given.values()
        place = [f"seed={seed}", f"hydra.sweep.dir={sweep_dir}", f"hydra.sweep.subdir={name}"]
        lines.append([*line, *place])
    return lines


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


def informational(args: list[str]) -> bool:
    """Hydra prints something (help, the config) instead of running."""
    return any(a.split("=")[0] in _HYDRA_INFO_FLAGS for a in args)
