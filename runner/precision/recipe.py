"""Recipes: what each converted Linear computes in, per direction (forward, input_grad,
weight_grad), as an ordered list of rules, first match wins. A rule's glob (fnmatch) is on module
names (`module:`, matching the Linear or any module it sits in) or class names (`class:`, the
same); each direction gets the run's converting format (fp8, mxfp8, nvfp4, mxfp4: the mode's) or
bf16 (autocast's), fp32 where the format's machinery computes it (nvfp4, mxfp4); all three fp32
in any mode (an fp32 island). The one place rules are parsed and matched: `precision.recipe=
FILE.yaml` (the user's rules and default), and the per-layer shorthands (fp32 islands,
precision.fp8/fp4's skip, min_features, keep_bf16, LoRA adapters), which runner/precision/
converted.py's chooser expands into rules of the same kind."""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from pathlib import Path

import yaml

from runner.errors import UserError

DIRECTIONS = ("forward", "input_grad", "weight_grad")
HIGH = ("bf16", "fp32")  # the formats a rule keeps a direction high in
ISLAND = ("fp32",) * len(DIRECTIONS)  # a rule keeping every direction fp32: an fp32 island
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

    def converts(self) -> bool:
        """Whether a Linear it decides is converted: a direction in the format, or bf16 beside
        fp32 (the FP4 emulation computes each direction apart). All bf16 leaves the Linear to
        autocast; all fp32 makes it an fp32 island (`island`)."""
        return len(set(self.formats)) > 1 or self.formats[0] not in HIGH

    def island(self) -> bool:
        return self.formats == ISLAND

    def describe(self) -> str:
        dirs = ", ".join(f"{d}: {f}" for d, f in zip(DIRECTIONS, self.formats, strict=True))
        return f"{{{self.on}: {self.pattern!r}, {dirs}}}  ({self.source})"

    def reason(self) -> str:
        """Why a Linear it decides is not converted (all its directions bf16, or all fp32)."""
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


def load(path: str, compute: str, fp8_recipe: str = "tensorwise") -> tuple[list[Rule], Rule | None]:
    """precision.recipe's (rules, default) for a mode computing in `compute`: the default
    (None where the file has none) decides the Linears no rule matches, after the shorthands
    (runner/precision/shorthands.py's `late`); each bad rule one line."""
    allowed = allowed_for(compute, fp8_recipe)
    rules, default = parse(path, defaults(compute, fp8_recipe), allowed)
    for rule in [*rules, default] if compute == "mxfp8" else ():
        if rule is not None and rule.converts() and rule.formats[:2] != ("mxfp8", "mxfp8"):
            dirs = ", ".join(f"{d}={f}" for d, f in zip(DIRECTIONS, rule.formats, strict=True))
            raise UserError(
                f"{KEY} {rule.source}: {dirs} is invalid under mxfp8: torchao's MXFP8Linear "
                "computes forward and input_grad in mxfp8 and keeps only weight_grad high "
                "(wgrad_with_hp): allowed: all three mxfp8, weight_grad bf16 alone, all three "
                "bf16 (the Linear left in bf16), all three fp32 (an fp32 island)"
            )
    return rules, default


def for_run(cfg, compute: str, caps) -> tuple[list[Rule], Rule | None]:
    """precision.recipe's (rules, default) (`cfg`: the precision group), each one the device
    can run."""
    if not cfg.get("recipe"):
        return [], None
    rules, default = load(cfg.recipe, compute, cfg.fp8.recipe)
    runnable([*rules, default] if default else rules, caps, cfg.allow_emulated)
    return rules, default


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


def parse(
    path: str, own: dict[str, str], allowed: dict[str, tuple[str, ...]]
) -> tuple[list[Rule], Rule | None]:
    """The file's rules and its `default` (a `{module: "*"}` rule, or None); `own`: the mode's
    format per direction, which a direction no rule names takes (the default's, where there is
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
        formats = _formats(default, f"{path}'s default rule", base, allowed)
        base = dict(zip(DIRECTIONS, formats, strict=True))
        default = Rule("module", "*", formats, f"the default rule of {path}")
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
    return rules, default


def _formats(entry, where: str, base: dict, allowed: dict) -> tuple[str, str, str]:
    """A rule's formats, the directions it leaves out taken from `base`; fp32 in a mode whose
    machinery does not compute it is allowed in all three directions (an fp32 island)."""
    if not isinstance(entry, dict):
        raise UserError(f"{KEY} {where} is invalid: a mapping of directions to formats")
    formats = dict(base)
    for direction, fmt in entry.items():
        if direction not in DIRECTIONS:
            raise UserError(
                f"{KEY} {where}: {direction!r} is not a direction (allowed: "
                f"{', '.join(DIRECTIONS)}; and module: or class: for the glob)"
            )
        formats[direction] = fmt
    out = tuple(formats[d] for d in DIRECTIONS)
    for direction, fmt in formats.items():
        if fmt not in allowed[direction] and out != ISLAND:
            island = "" if "fp32" in allowed[direction] else "; fp32 in all three (an fp32 island)"
            raise UserError(
                f"{KEY} {where}: {direction}={fmt!r} is invalid: allowed: "
                f"{', '.join(allowed[direction])}{island}"
            )
    return out


def chains(model) -> dict[str, list[tuple[str, str]]]:
    """Each module's (name, class) and those of every module it sits in, by name."""
    out: dict[str, list[tuple[str, str]]] = {}
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0] if "." in name else ("" if name else None)
        up = out.get(parent, []) if parent is not None else []
        out[name] = [(name, type(module).__name__), *up]
    return out


def unmatched(rules: list[Rule], model, linears: list[str]) -> None:
    """A rule of the file that matches no Linear (`linears`: their names), neither the Linear
    nor a module it sits in, is one error line."""
    chain_of = chains(model)
    for rule in rules:
        if not any(rule.matches(chain_of[name]) for name in linears):
            what = "name" if rule.on == "module" else "class"
            hit = next((n for n, c in chain_of.items() if c and rule.matches(c[:1])), None)
            but = f"; it matches {hit!r}, which holds none" if hit is not None else ""
            raise UserError(
                f"{KEY} {rule.source}: {rule.on}: {rule.pattern!r} matches no Linear's {what} "
                f"nor that of a module a Linear sits in{but} (globs are fnmatch on names as in "
                "model.named_modules(), e.g. net.blocks.0.*, or on class names)"
            )


def first_match(rules: list[Rule], chain: list[tuple[str, str]]) -> Rule | None:
    return next((r for r in rules if r.matches(chain)), None)


def float8_config(float8, config, formats: tuple[str, str, str]):
    """`config` with both operands of each GEMM `formats` keeps high (bf16) disabled: forward
    (input, weight), input_grad (grad_output, weight_for_grad_input), weight_grad
    (input_for_grad_weight, grad_output_for_grad_weight). A disabled cast is tensorwise: torchao
    scales axiswise (the rowwise recipes) only dynamically."""
    off = float8.ScalingType.DISABLED
    tensorwise = float8.ScalingGranularity.TENSORWISE
    operands = (
        ("cast_config_input", "cast_config_weight"),
        ("cast_config_grad_output", "cast_config_weight_for_grad_input"),
        ("cast_config_input_for_grad_weight", "cast_config_grad_output_for_grad_weight"),
    )
    changes = {
        key: dataclasses.replace(
            getattr(config, key), scaling_type=off, scaling_granularity=tensorwise
        )
        for fmt, keys in zip(formats, operands, strict=True)
        if fmt != "fp8"
        for key in keys
    }
    # every operand's config explicit: a GEMM left in fp8 keeps the recipe's cast
    explicit = {key: getattr(config, key) for keys in operands for key in keys}
    return dataclasses.replace(config, **(explicit | changes))
