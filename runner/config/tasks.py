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
    if isinstance(model, DictConfig) and isinstance(dataset, DictConfig) and "seq_len" in dataset:
        for key in ("max_position_embeddings", "n_positions"):
            if key in model:
                require(
                    dataset.seq_len <= model[key],
                    "dataset.seq_len",
                    dataset.seq_len,
                    f"must be ≤ model.{key} ({model[key]})",
                )
