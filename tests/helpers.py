"""Shared test helpers: composing real configs, small sizes, reading run outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import runner

# A BERT small enough for a CPU test step in milliseconds (on a small generated corpus).
TINY_BERT_MODEL = [
    "model=bert",
    "model.hidden_size=32",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.intermediate_size=64",
    "model.dropout=0",
    "dataset.seq_len=32",
    "dataset.batch_size=8",
    "dataset.vocab_size=512",
    "trainer.progress_bar=false",
    "logger=none",
]
TINY_BERT = [*TINY_BERT_MODEL, "dataset.num_documents=200"]
TINY_MLP = ["model=mlp", "dataset.num_samples=1024", "trainer.progress_bar=false", "logger=none"]


def module_run(net: str, *overrides: str) -> list[str]:
    """A two-step `model=module` run of the net class at dotted path `net`, on the small pairs of
    tests/test_own_model.py, without evaluation."""
    return [
        "model=module",
        f"model.net._target_={net}",
        "dataset.train._target_=tests.test_own_model.pairs",
        "dataset.batch_size=16",
        "trainer.max_steps=2",
        "trainer.val_check_interval=0",
        "trainer.progress_bar=false",
        "logger=none",
        *overrides,
    ]


def make_cfg(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(runner.CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def load_last(run_dir: Path) -> dict:
    return torch.load(Path(run_dir) / "checkpoints" / "last.pt", weights_only=True)


def cli(
    *args: str, cwd, env: dict | None = None, launcher: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """`python [LAUNCHER] -m runner ARGS` in a subprocess, as a user runs it."""
    return subprocess.run(
        [sys.executable, *launcher, "-m", "runner", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # generous for a loaded machine; a run that ends sooner returns sooner
    )


def unigram_entropy(data) -> float:
    """Entropy (nats) of the training tokens' unigram distribution: the loss of a model that
    ignores context."""
    import numpy as np

    counts = torch.bincount(
        torch.from_numpy(np.asarray(data.splits["train"]["input_ids"])).flatten()
    )
    p = counts[counts > 0].double() / counts.sum()
    return float(-(p * p.log()).sum())


def error_record(module, direction, sqnr, *, step=1, fmt="nvfp4", flushed=0.0) -> dict:
    """One `matmul_error` record as summary.json holds it: operand a's flushed share `flushed`."""
    operands = {"a": {"underflow": flushed}, "b": {"underflow": 0.0}}
    return {"module": module, "direction": direction, "format": fmt, "sqnr_db": sqnr} | {
        "operands": operands,
        "step": step,
    }
