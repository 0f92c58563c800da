"""What every way of running a config starts with: the seeds, and the dataset and model built from
their groups (run.py, the comparison's interleaved timing, the answers, export)."""

from __future__ import annotations

import random

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from runner.errors import building
from runner.task import DataModule, Task


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # CUDA generators too


def build(cfg: DictConfig) -> tuple[DataModule, Task]:
    """Dataset first (the model needs its vocabulary and shapes), then the model, on the CPU.
    A value the constructor cannot take is a UserError that names the group."""
    with building("dataset", cfg.dataset):
        data = instantiate(cfg.dataset)
    with building("model", cfg.model):
        task = instantiate(cfg.model, data=data)
    return data, task
