"""The found recipe in the forms users' trainers read, written beside recipe.yaml by `python -m
runner.recipe`: torchao's module filter (`recipe_filter.py`: `module_filter_fn(module, fqn)`,
True for the Linears to convert, for `convert_to_float8_training(module_filter_fn=...)` and
`quantize_(filter_fn=...)`) and torchtitan's `filter_fqns` (`recipe_torchtitan.toml`: the
Linears its float8 or mx converter must not convert).

Both say per module whether it converts; a recipe says it per direction. A Linear whose recipe
keeps some directions in bf16 and computes the others in the format (a per-direction rule, e.g.
nvfp4's weight_grad alone in bf16, or mxfp8's `wgrad_with_hp`) is written as kept entirely in high
precision: converted whole, it would compute in the format the direction the search's runs needed
in bf16, which none of them passed; kept whole, it computes every direction at least as precisely
as the recipe does, at the cost of its other directions' speed. Each file names those Linears.

Names are as the user's model has them: the runner's task holds the model as one child (`net`
for model=module and model=hf, `model` for model=gpt), whose prefix is dropped. GPT-2's Conv1D
projections, which the runner converts as Linears and torchao's converters do not, are named as
such, with what to do."""

from __future__ import annotations

import json
from pathlib import Path

from runner.files import write_text

FILTER_FILE, TORCHTITAN_FILE = "recipe_filter.py", "recipe_torchtitan.toml"
# torchtitan's converter config sections (older releases: [float8], [mx])
SECTIONS = {
    "fp8": "quantize.linear.float8",
    "mxfp8": "quantize.linear.mx",
    "mxfp4": "quantize.linear.mx",
}
USES = {
    "fp8": "torchao.float8.convert_to_float8_training(model, module_filter_fn=module_filter_fn)",
    "mxfp8": "torchao's MXFP8Linear for each Linear where module_filter_fn is True "
    "(quantize_(model, MXFP8TrainingOpConfig(...), filter_fn=module_filter_fn))",
}
HIGH = ("bf16", "fp32")


def split(report: dict, prefix: str) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """The run's Linears (`report`: its converted Linears' report) as (converted whole, {converted
    with directions kept high: those directions}, not converted), named without `prefix`."""
    directions = report.get("directions", {})
    whole, partial = [], {}
    for name in report["converted"]:
        high = [d for d, f in directions.get(name, {}).items() if f in HIGH]
        if high:
            partial[name.removeprefix(prefix)] = high
        else:
            whole.append(name)
    keep = [n.removeprefix(prefix) for n in [*report["converted"], *report["skipped"]]]
    keep = [n for n in keep if prefix + n not in whole]
    return [n.removeprefix(prefix) for n in whole], partial, keep


def prefix_of(parameters: list[str]) -> str:
    """The task's child that holds the user's model (`net.`), where it holds every parameter
    (`parameters`: the task's parameter names); else none."""
    heads = {n.split(".")[0] for n in parameters}
    return f"{heads.pop()}." if len(heads) == 1 and all("." in n for n in parameters) else ""


def _unsaid(partial: dict[str, list[str]], mode: str) -> list[str]:
    if not partial:
        return ["# Nothing unsaid: the recipe keeps no direction of a converted Linear apart."]
    lines = [
        f"# Not said by a per-module form: these Linears compute in {mode} but for the directions",
        "# named, which the recipe keeps in bf16. Here they are kept entirely in high precision:",
        "# converted whole they would compute those directions in the format, which no run of the",
        "# search passed; kept whole, each direction is at least as precise as the recipe's.",
    ]
    return lines + [f"#   {n}: {', '.join(d)} in bf16" for n, d in partial.items()]


def _conv1d(report: dict, prefix: str) -> list[str]:
    """The converted Linears that are transformers' Conv1D in the user's model (GPT-2's
    projections), which the runner computes as the nn.Linear each stands for and torchao's
    converters leave as they are."""
    names = [n.removeprefix(prefix) for n in report.get("from_conv1d", [])]
    if not names:
        return []
    return [
        f"# Conv1D: {len(names)} of these modules are transformers' Conv1D (GPT-2's projections),",
        "# which the runner converted as the nn.Linear each computes. torchao's converters swap",
        "# nn.Linear only: applied as is to such a model, this converts none of them (they train",
        "# in bf16). Replace each Conv1D by its nn.Linear first (in_features = weight.shape[0],",
        "# weight = the Conv1D's weight transposed, the same bias), then convert:",
        *(f"#   {n}" for n in names),
    ]


def write(out: Path, mode: str, report: dict, found: str, prefix: str = "") -> list[Path]:
    """The forms of the recipe whose run converted as `report` says, in `out`, its names without
    `prefix`; `found`: the line saying where it came from. Returns the files written."""
    convert, partial, keep = split(report, prefix)
    unsaid = _unsaid(partial, mode) + _conv1d(report, prefix)
    use = USES.get(
        mode, f"quantize_(model, <your {mode} training config>, filter_fn=module_filter_fn)"
    )
    snippet = [
        f"# {found}",
        "# As torchao's module filter: module_filter_fn(module, fqn) is True for the Linears the",
        f"# recipe converts to {mode}, False for every other module. Use: {use}.",
        "# fqn: as your model names its modules, before a wrapper (FSDP, torch.compile) prefixes them.",
        *unsaid,
        "",
        f"CONVERT = frozenset({sorted(convert)!r})",
        f"KEEP_HIGH = frozenset({sorted(keep)!r})  # for reading: the filter says False for them",
        "",
        "",
        "def module_filter_fn(module, fqn: str) -> bool:",
        f'    """True where the recipe converts the Linear `fqn` to {mode}."""',
        "    return fqn in CONVERT",
    ]
    written = [out / FILTER_FILE]
    write_text(written[0], "\n".join(snippet) + "\n")
    if mode in SECTIONS:
        written.append(out / TORCHTITAN_FILE)
        write_text(written[1], _torchtitan(mode, convert, keep, unsaid, found))
    return written


def _torchtitan(
    mode: str, convert: list[str], keep: list[str], unsaid: list[str], found: str
) -> str:
    clashes = [f"#   {k!r} is part of {c!r}" for k in keep for c in convert if k in c]
    lines = [
        f"# {found}",
        f"# For torchtitan's {'float8' if mode == 'fp8' else 'mx'} converter: filter_fqns are the "
        "Linears it must not convert. It",
        "# skips every module whose fqn CONTAINS an entry (a substring), and every Linear with a",
        "# dimension not a multiple of 16 anyway. In older releases the section is "
        f"[{SECTIONS[mode].rsplit('.', 1)[-1]}].",
        *unsaid,
        *(
            ["# Entries that also match a Linear the recipe converts (torchtitan would skip it):"]
            + clashes
            if clashes
            else []
        ),
        f"[{SECTIONS[mode]}]",
        "filter_fqns = [" + ", ".join(json.dumps(k) for k in keep) + "]",  # TOML strings
    ]
    return "\n".join(lines) + "\n"
