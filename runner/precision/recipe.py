"""Recipes: what each converted Linear computes in, per direction (forward, input_grad,
weight_grad), as an ordered list of rules, first match wins. A rule's glob (fnmatch) is on module
names (`module:`, matching the Linear or any module it sits in) or class names (`class:`, the
same); each direction gets the run's converting format (fp8, mxfp8, nvfp4, mxfp4: the mode's) or
bf16 (autocast's), fp32 where the format's machinery computes it (nvfp4, mxfp4). The one place
rules are parsed and matched: `precision.recipe=FILE.yaml` (the user's rules), and the per-layer
shorthands (fp32 islands, precision.fp8/fp4's skip, min_features, keep_bf16, LoRA adapters),
which runner/precision/converted.py's chooser expands into rules of the same kind."""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from pathlib import Path

import yaml

from runner.errors import UserError

DIRECTIONS = ("forward", "input_grad", "weight_grad")
HIGH = ("bf16", "fp32")  # the formats a rule keeps a direction high in
KEY = "precision.recipe"


@dataclass(frozen=True)
class Rule:
    """One rule: `on` is "module" or "class", `pattern` its fnmatch glob, `formats` one per
    direction (DIRECTIONS' order), `source` where it comes from (the file's rule, or the
    shorthand's key), `why` the words a Linear it keeps out of the format is listed with."""

    on: str
    pattern: str
    formats: tuple[str, str, str]
    source: str
    why: str = ""

    def matches(self, chain: list[tuple[str, str]]) -> bool:
        """Whether it matches a Linear: `chain` is (name, class) of it and each module it sits in."""
        i = 0 if self.on == "module" else 1
        return any(fnmatch.fnmatchcase(link[i], self.pattern) for link in chain)

    def low(self) -> bool:
        """Whether it puts any direction in the converting format."""
        return any(f not in HIGH for f in self.formats)

    def describe(self) -> str:
        dirs = ", ".join(f"{d}: {f}" for d, f in zip(DIRECTIONS, self.formats, strict=True))
        return f"{{{self.on}: {self.pattern!r}, {dirs}}}  ({self.source})"

    def reason(self) -> str:
        """Why a Linear it matches is not converted (all its directions high)."""
        return self.why or f"{self.formats[0]} by {self.source}"


def allowed_for(compute: str, fp8_recipe: str = "tensorwise") -> dict[str, tuple[str, ...]]:
    """Direction → the formats the mode's machinery computes it in: torchao's float8 each GEMM
    in fp8 or bf16 (a disabled cast; rowwise_with_gw_hp's weight gradient bf16 only), MXFP8 each
    in mxfp8 or bf16 (forward and input_grad together: see `parse`), the FP4 emulation each in
    its format, bf16 or fp32."""
    if compute in ("nvfp4", "mxfp4"):
        return dict.fromkeys(DIRECTIONS, (compute, *HIGH))
    allowed = dict.fromkeys(DIRECTIONS, (compute, "bf16"))
    if compute == "fp8" and fp8_recipe == "rowwise_with_gw_hp":
        allowed["weight_grad"] = ("bf16",)
    return allowed


def defaults(compute: str, fp8_recipe: str = "tensorwise") -> dict[str, str]:
    """The mode's own formats, a direction no rule names (rowwise_with_gw_hp's weight gradient:
    bf16)."""
    return {d: allowed_for(compute, fp8_recipe)[d][0] for d in DIRECTIONS}


def load(path: str, compute: str, fp8_recipe: str = "tensorwise") -> list[Rule]:
    """precision.recipe's rules for a mode computing in `compute`; each bad rule one line."""
    rules = parse(path, defaults(compute, fp8_recipe), allowed_for(compute, fp8_recipe))
    for rule in rules if compute == "mxfp8" else ():
        forward, input_grad, _ = rule.formats
        if forward != input_grad:
            raise UserError(
                f"{KEY} {rule.source}: forward={forward} with input_grad={input_grad} is invalid "
                "under mxfp8: torchao's MXFP8Linear computes both in one format (it switches "
                "weight_grad alone): allowed: both mxfp8, or both bf16 (the module left in bf16)"
            )
    return rules


def for_run(cfg, compute: str, caps) -> list[Rule]:
    """precision.recipe's rules (`cfg`: the precision group), each one the device can run."""
    if not cfg.get("recipe"):
        return []
    rules = load(cfg.recipe, compute, cfg.fp8.recipe)
    runnable(rules, caps, cfg.allow_emulated)
    return rules


def runnable(rules: list[Rule], caps, allow_emulated: bool) -> None:
    """A rule's bf16 on a GPU without bf16 units is refused, as precision=bf16 is there (unless
    precision.allow_emulated=true): one line naming the rule."""
    for rule in rules:
        for direction, fmt in zip(DIRECTIONS, rule.formats, strict=True):
            native, why = caps.support(fmt) if fmt in HIGH else (True, "")
            if not native and caps.type == "cuda" and not allow_emulated:
                raise UserError(
                    f"{KEY} {rule.source}: {direction}={fmt} cannot run natively here: {why} "
                    f"(allowed: {', '.join(f for f in HIGH if caps.support(f)[0])} or the mode's "
                    "format, or precision.allow_emulated=true)"
                )


def read(path: str) -> object:
    """The recipe file's YAML: a missing file or one that is not YAML is one error line."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"{KEY}={path!r} is invalid: no such file (a YAML file of rules)")
    try:
        return yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where else ""
        raise UserError(f"{KEY}={path!r} is invalid: not YAML{at} ({first(e)})") from None


def first(e: Exception) -> str:
    return str(getattr(e, "problem", None) or e).splitlines()[0]


def parse(path: str, own: dict[str, str], allowed: dict[str, tuple[str, ...]]) -> list[Rule]:
    """The file's rules, its `default` last (a `{module: "*"}` rule); `own`: the mode's format
    per direction, which a direction no rule names takes (the default rule's, where there is
    one); `allowed`: direction → the formats the mode's machinery computes it in."""
    raw = read(path)
    default = None
    if isinstance(raw, dict):
        unknown = set(raw) - {"rules", "default"}
        if unknown:
            raise UserError(
                f"{KEY}={path!r} is invalid: unknown key {sorted(unknown)[0]!r} "
                "(allowed: rules, a list; default, a rule's directions)"
            )
        default, raw = raw.get("default"), raw.get("rules") or []
    if not isinstance(raw, list):
        raise UserError(
            f"{KEY}={path!r} is invalid: a list of rules, or a mapping with rules: and default: "
            f"(got {type(raw).__name__})"
        )
    base = dict(own)
    if default is not None:
        base = _formats(default, f"{path}'s default rule", base, allowed)
    rules = []
    for i, entry in enumerate(raw, 1):
        where = f"{path}'s rule {i}"
        if not isinstance(entry, dict):
            raise UserError(
                f"{KEY} {where} is invalid: a mapping, as {{module: GLOB, forward: bf16}}"
            )
        targets = [k for k in ("module", "class") if k in entry]
        if len(targets) != 1 or not isinstance(entry[targets[0]], str) or not entry[targets[0]]:
            raise UserError(
                f"{KEY} {where} {entry!r} is invalid: one of module: or class: with a glob "
                "(fnmatch) of module or class names"
            )
        on = targets[0]
        directions = {k: v for k, v in entry.items() if k != on}
        formats = _formats(directions, where, base, allowed)
        rules.append(Rule(on, entry[on], formats, f"rule {i} of {path}"))
    if default is not None:
        formats = tuple(base[d] for d in DIRECTIONS)
        rules.append(Rule("module", "*", formats, f"the default rule of {path}"))
    return rules


def _formats(entry, where: str, base: dict, allowed: dict) -> tuple[str, str, str]:
    if not isinstance(entry, dict):
        raise UserError(f"{KEY} {where} is invalid: a mapping of directions to formats")
    formats = dict(base)
    for direction, fmt in entry.items():
        if direction not in DIRECTIONS:
            raise UserError(
                f"{KEY} {where}: {direction!r} is not a direction (allowed: "
                f"{', '.join(DIRECTIONS)}; and module: or class: for the glob)"
            )
        if fmt not in allowed[direction]:
            raise UserError(
                f"{KEY} {where}: {direction}={fmt!r} is invalid: allowed: "
                f"{', '.join(allowed[direction])}"
            )
        formats[direction] = fmt
    return tuple(formats[d] for d in DIRECTIONS)


def chains(model) -> dict[str, list[tuple[str, str]]]:
    """Each module's (name, class) and those of every module it sits in, by name."""
    out: dict[str, list[tuple[str, str]]] = {}
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0] if "." in name else ("" if name else None)
        up = out.get(parent, []) if parent is not None else []
        out[name] = [(name, type(module).__name__), *up]
    return out


def unmatched(rules: list[Rule], model) -> None:
    """A rule of the file whose glob matches no module of the model is one error line."""
    links = [link for chain in chains(model).values() for link in chain[:1]]
    for rule in rules:
        if not any(rule.matches([link]) for link in links):
            what = "module" if rule.on == "module" else "module's class"
            raise UserError(
                f"{KEY} {rule.source}: {rule.on}: {rule.pattern!r} matches no {what} of the "
                "model (globs are fnmatch on names as in model.named_modules(), e.g. net.blocks.0.*)"
            )


def first_match(rules: list[Rule], chain: list[tuple[str, str]]) -> Rule | None:
    return next((r for r in rules if r.matches(chain)), None)


def float8_config(float8, config, formats: tuple[str, str, str]):
    """`config` with both operands of each GEMM `formats` keeps high (bf16) disabled: forward
    (input, weight), input_grad (grad_output, weight_for_grad_input), weight_grad
    (input_for_grad_weight, grad_output_for_grad_weight)."""
    off = float8.ScalingType.DISABLED
    operands = (
        ("cast_config_input", "cast_config_weight"),
        ("cast_config_grad_output", "cast_config_weight_for_grad_input"),
        ("cast_config_input_for_grad_weight", "cast_config_grad_output_for_grad_weight"),
    )
    changes = {
        key: dataclasses.replace(getattr(config, key), scaling_type=off)
        for fmt, keys in zip(formats, operands, strict=True)
        if fmt != "fp8"
        for key in keys
    }
    # every operand's config explicit: a GEMM left in fp8 keeps the recipe's cast
    explicit = {key: getattr(config, key) for keys in operands for key in keys}
    return dataclasses.replace(config, **(explicit | changes))
