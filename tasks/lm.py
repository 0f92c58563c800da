"""Causal language modelling: a GPT-2 built from a `GPT2Config` (nothing downloaded)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from runner.task import Batch, DataModule, Task
from tasks.text import check_transformer


class GPT(Task):
    def __init__(
        self,
        data: DataModule,
        n_embd: int,
        n_layer: int,
        n_head: int,
        n_positions: int,
        dropout: float,
        initializer_range: float,
        attn_implementation: str = "sdpa",
    ):
        super().__init__()
        check_transformer(
            data, "gpt", ("n_embd", n_embd), ("n_head", n_head), ("n_positions", n_positions)
        )
        data.use_objective("causal")
        config = GPT2Config(
            vocab_size=data.vocab_size,
            n_positions=n_positions,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            resid_pdrop=float(dropout),
            embd_pdrop=float(dropout),
            attn_pdrop=float(dropout),
            initializer_range=float(initializer_range),
            # the token between documents: [SEP] when trained, a pretrained one's sep or eos
            bos_token_id=data.sep_id,
            eos_token_id=data.sep_id,
        )
        config._attn_implementation = attn_implementation
        self.model = GPT2LMHeadModel(config)

    def shard_units(self) -> list[torch.nn.Module]:
        return list(self.model.transformer.h)

    def output_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()  # tied to the input embedding

    def _logits(self, batch: Batch) -> torch.Tensor:
        """Position t's prediction of token t+1."""
        return self.model(input_ids=batch["input_ids"]).logits[:, :-1]

    @staticmethod
    def _loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(
            logits.flatten(0, 1), batch["labels"][:, 1:].flatten(), reduction="sum"
        )

    def forward(self, batch: Batch) -> torch.Tensor:
        return self._loss(self._logits(batch), batch)

    def eval_sums(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {"loss": self._loss(self.predicted(self._logits(batch)), batch)}

    def num_targets(self, batch: Batch) -> int:
        ids = batch["input_ids"]
        return ids.shape[0] * (ids.shape[1] - 1)

    def num_tokens(self, batch: Batch) -> int:
        return batch["input_ids"].numel()

    def eval_metrics(self, totals: dict[str, float], count: int) -> dict[str, float]:
        loss = totals["loss"] / max(count, 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}
