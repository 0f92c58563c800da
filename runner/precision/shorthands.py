"""The per-layer shorthands as recipe rules (runner/precision/recipe.py): fp32 islands, the
user's recipe file's rules, precision.fp8's (or fp4's) keep_bf16 blocks, LoRA's adapters,
min_features, skip (`first`, `last` and name patterns), and the recipe file's default or the
mode's, in that order of precedence (first match wins). The shorthands' keys stay public; each
becomes a rule that names its key and keeps the words a Linear it leaves out is listed with in
`converted.skipped`."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from runner import console
from runner.errors import UserError
from runner.precision.adapters import adapter_parameters
from runner.precision.recipe import DIRECTIONS, Rule
from runner.task import Task

FIRST, LAST = "first", "last"  # in `skip`: the model's first and last Linear layers
ADAPTER = (
    "a fine-tune's adapter (model.peft), left in autocast's dtype (precision.fp8.convert_adapters)"
)
BF16 = ("bf16",) * len(DIRECTIONS)


def early(chooser, model: nn.Module, islands: Iterable[nn.Module]) -> list[Rule]:
    """The rules before the format's own constraints (dimensions, a plain Linear): fp32 islands,
    the recipe file's rules, keep_bf16's blocks, LoRA's adapters."""
    names = {id(m): n for n, m in model.named_modules()}
    rules = [
        Rule(
            "module", names[id(i)], ("fp32",) * 3, "precision.fp32_modules", "inside an fp32 island"
        )
        for i in islands
    ]
    rules += chooser.user_rules
    rules += [
        Rule("module", names[id(block)], BF16, f"{chooser.keys}.keep_bf16.{end}", why)
        for block, end, why in _kept_blocks(chooser, model)
    ]
    adapters = set() if chooser.convert_adapters else adapter_parameters(model)
    rules += [
        Rule("module", n, BF16, "precision.fp8.convert_adapters", ADAPTER)
        for n, m in model.named_modules()
        if not adapters.isdisjoint(m.parameters(False))
    ]
    return rules


def late(chooser, linears: list[tuple[str, nn.Module]], dims) -> list[Rule]:
    """The rules after the format's constraints: min_features, skip, and last the recipe
    file's default (precision.recipe's `default:`), else the mode's."""
    keys, order = chooser.keys, [n for n, _ in linears]
    small = chooser.min_features
    rules = [
        Rule("module", n, BF16, f"{keys}.min_features", f"smaller than {keys}.min_features={small}")
        for n, m in linears
        if min(dims(m)) < small
    ]
    for pattern in chooser.patterns:
        if pattern in (FIRST, LAST):
            if order:
                name = order[0] if pattern == FIRST else order[-1]
                why = f"the {pattern} Linear layer ({keys}.skip)"
                rules.append(Rule("module", name, BF16, f"{keys}.skip={pattern}", why))
        else:
            why = f"matches {pattern!r} ({keys}.skip)"
            rules.append(Rule("module", pattern, BF16, f"{keys}.skip", why))
    default = chooser.user_default or Rule(
        "module", "*", chooser.default_formats(), f"precision={chooser.compute}'s default"
    )
    return [*rules, default]


def _kept_blocks(chooser, model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(block, end, why) for the blocks keep_bf16 leaves in bf16: the first and last of the
    task's blocks (`Task.shard_units`, those FSDP shards one by one)."""
    first, last = chooser.keep_bf16
    keys = chooser.keys
    if not first and not last:
        return []
    blocks = model.shard_units() if isinstance(model, Task) else []
    if not blocks:  # nvfp4's default keeps the last block: a model without blocks runs on
        console.say(
            f"note: {keys}.keep_bf16 keeps no block: the model has none "
            "(no nn.ModuleList or nn.Sequential of blocks)"
        )
        return []
    if first + last > len(blocks):
        raise UserError(
            f"{keys}.keep_bf16: first={first} and last={last} blocks, but the model has "
            f"{len(blocks)} (those FSDP shards: Task.shard_units)"
        )
    kept = []
    for i, block in enumerate(blocks):
        end = FIRST if i < first else LAST if i >= len(blocks) - last else None
        if end:
            count = first if end == FIRST else last
            kept.append(
                (block, end, f"in block {i} of {len(blocks)} ({keys}.keep_bf16.{end}={count})")
            )
    return kept
