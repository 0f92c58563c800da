"""BERT masked-language modelling: `transformers.BertForMaskedLM` built from a `BertConfig`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM

from runner.task import Batch, DataModule, Task
from tasks.text import IGNORE_INDEX, check_transformer


class BertMLM(Task):
    def __init__(
        self,
        data: DataModule,
        hidden_size: int,
        num_hidden_layers: int,
        num_attention_heads: int,
        intermediate_size: int,
        initializer_range: float,
        layer_norm_eps: float,
        max_position_embeddings: int,
        dropout: float,
        attn_implementation: str = "sdpa",
    ):
        super().__init__()
        check_transformer(
            data,
            "bert",
            ("hidden_size", hidden_size),
            ("num_attention_heads", num_attention_heads),
            ("max_position_embeddings", max_position_embeddings),
        )
        config = BertConfig(
            vocab_size=data.vocab_size,
            hidden_size=hidden_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            intermediate_size=intermediate_size,
            # float(): `model.dropout=0` on the command line arrives as an int
            initializer_range=float(initializer_range),
            layer_norm_eps=float(layer_norm_eps),
            max_position_embeddings=max_position_embeddings,
            hidden_dropout_prob=float(dropout),
            attention_probs_dropout_prob=float(dropout),
            pad_token_id=data.pad_id,  # the corpus's tokenizer: trained or pretrained
        )
        config._attn_implementation = attn_implementation
        self.model = BertForMaskedLM(config)

    def shard_units(self) -> list[torch.nn.Module]:
        return list(self.model.bert.encoder.layer)

    def output_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()  # tied to the input embedding

    def _logits_and_labels(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        # Blocks are full (no padding), so no attention mask is needed.
        logits = self.model(input_ids=batch["input_ids"]).logits
        return logits.flatten(0, 1), batch["labels"].flatten()

    def forward(self, batch: Batch) -> torch.Tensor:
        logits, labels = self._logits_and_labels(batch)
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")

    def num_targets(self, batch: Batch) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def num_tokens(self, batch: Batch) -> int:
        return batch["input_ids"].numel()

    def eval_sums(self, batch: Batch) -> dict[str, torch.Tensor]:
        logits, labels = self._logits_and_labels(batch)
        logits = self.predicted(logits)
        return {
            "loss": F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"),
            "accuracy": (logits.argmax(-1) == labels).sum(),
        }
