"""The documented keys of the task-owned groups (conf/model, conf/dataset), checked wherever a
group has them, so that a bad value names its key rather than the constructor's complaint."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig

from runner.config.rules import integer, number, require

# The documented keys of the task-owned groups (conf/model, conf/dataset), wherever a group has
# one: (what is allowed, the check). A bad value then names its key, not the constructor's
# complaint ("high <= 0", "'<' not supported between instances of 'str' and 'int'").
_POSITIVE = ("an integer ≥ 1", lambda v: integer(v) and v >= 1)
_FRACTION = ("a number in [0, 1)", lambda v: number(v) and 0 <= v < 1)
_SMALL = ("a number > 0", lambda v: number(v) and v > 0)
TASK_KEYS: dict[str, dict[str, tuple[str, Any]]] = {
    "model": {
        **dict.fromkeys(
            (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "intermediate_size",
                "max_position_embeddings",
                "num_layers",
                "n_embd",
                "n_layer",
                "n_head",
                "n_positions",
                "width",
                "depth",
                "latent_dim",
            ),
            _POSITIVE,
        ),
        "dropout": _FRACTION,
        "initializer_range": _SMALL,
        "layer_norm_eps": _SMALL,
        "blocks_per_stage": (
            "a list of integers ≥ 1",
            lambda v: isinstance(v, ListConfig) and len(v) > 0 and all(_POSITIVE[1](x) for x in v),
        ),
    },
    "dataset": {
        **dict.fromkeys(
            (
                "batch_size",
                "num_samples",
                "num_documents",
                "num_features",
                "num_classes",
                "vocab_size",
                "seq_len",
                "image_size",
                "channels",
                "shapes_per_image",
                "words_per_document",
                "vocab_words",
                "num_topics",
            ),
            _POSITIVE,
        ),
        "num_workers": ("an integer ≥ 0", lambda v: integer(v) and v >= 0),
        "validation_fraction": _FRACTION,
        "mlm_probability": ("a number in (0, 1)", lambda v: number(v) and 0 < v < 1),
    },
}
# model.peft (tasks/adapters.py): its short names for peft.LoraConfig's fields (any other key is a
# field by its own name), the fields the runner sets itself, and the checks of its values.
PEFT_ALIASES = {"alpha": "lora_alpha", "dropout": "lora_dropout"}
PEFT_FIXED = ("peft_type", "inference_mode", "peft_version", "auto_mapping")
PEFT_KEYS: dict[str, tuple[str, Any]] = {
    "r": _POSITIVE,
    "lora_alpha": _SMALL,
    "lora_dropout": _FRACTION,
    "target_modules": (
        "a list of module names, or one pattern (all-linear, a regex)",
        lambda v: isinstance(v, str) or (isinstance(v, ListConfig) and len(v) > 0),
    ),
    "bias": ("none, all or lora_only", lambda v: v in ("none", "all", "lora_only")),
}
# Pairs of keys in one group where the first must be a multiple of the second (attention heads).
DIVISIBLE = (("hidden_size", "num_attention_heads"), ("n_embd", "n_head"))


def validate_task(cfg: DictConfig) -> None:
    for group, checks in TASK_KEYS.items():
        node = cfg.get(group)
        if not isinstance(node, DictConfig):
            continue
        for key, (allowed, ok) in checks.items():
            if key in node:
                require(ok(node[key]), f"{group}.{key}", node[key], f"must be {allowed}")
        for whole, part in DIVISIBLE:
            if whole in node and part in node:
                require(
                    node[whole] % node[part] == 0,
                    f"{group}.{whole}",
                    node[whole],
                    f"must be a multiple of {group}.{part} ({node[part]})",
                )
    model, dataset = cfg.get("model"), cfg.get("dataset")
    if isinstance(model, DictConfig) and model.get("peft") is not None:
        _validate_peft(model.peft)
    if isinstance(model, DictConfig) and isinstance(dataset, DictConfig) and "seq_len" in dataset:
        for key in ("max_position_embeddings", "n_positions"):
            if key in model:
                require(
                    dataset.seq_len <= model[key],
                    "dataset.seq_len",
                    dataset.seq_len,
                    f"must be ≤ model.{key} ({model[key]})",
                )


def _validate_peft(spec) -> None:
    """model.peft: a mapping of LoRA settings, each a peft.LoraConfig field (or its alias) with a
    value LoraConfig would take (it checks few itself: r=0 builds adapters that do nothing)."""
    example = "{r: 8, alpha: 16, target_modules: [q_proj, v_proj]}"
    require(isinstance(spec, DictConfig), "model.peft", spec, f"null or a mapping, e.g. {example}")
    import dataclasses

    import peft  # only where model.peft is set: it takes seconds

    fields = {f.name for f in dataclasses.fields(peft.LoraConfig)} - set(PEFT_FIXED)
    for key in spec:
        name = PEFT_ALIASES.get(key, key)
        allowed = ", ".join([*PEFT_ALIASES, "or peft.LoraConfig's fields (r, target_modules, ...)"])
        require(name in fields, f"model.peft.{key}", spec[key], f"not a LoRA setting: {allowed}")
        twice = key != name and name in spec
        require(not twice, f"model.peft.{key}", spec[key], f"set once: {key} or {name}")
        if name in PEFT_KEYS:
            what, ok = PEFT_KEYS[name]
            require(ok(spec[key]), f"model.peft.{key}", spec[key], f"must be {what}")
