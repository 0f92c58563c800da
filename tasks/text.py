"""Text data for masked-language modelling, through Hugging Face `datasets`.

Three sources share one path: `TextFiles` (local text, json, csv or parquet), `HubText` and
`GeneratedText` (a corpus written locally from the seed). Each trains a WordPiece tokenizer on the
training text and caches it, or uses a pretrained one (`dataset.tokenizer`), then tokenizes with a
cached `map` and cuts the token stream into blocks. Loading and tokenizers: `tasks/text_data.py`.
"""

from __future__ import annotations

import os
from pathlib import Path

import datasets
import numpy as np
import torch

from runner.errors import UserError
from runner.task import Batch, DataModule, require_kind, sample_rng
from tasks.text_data import (
    MASK_ID,
    PAD_ID,
    SEP_ID,
    SPECIAL_TOKENS,
    _atomic_write,
    _digest,
    _expand,
    load_pretrained_tokenizer,
    load_text,
    train_tokenizer,
)

IGNORE_INDEX = -100


class TextCorpus(DataModule):
    """Token blocks of `seq_len` for MLM, with 15% of tokens masked by the 80/10/10 rule. The mask
    of a sample is fixed by (seed, epoch, index), never by batch size or resume point.

    `tokenizer`: None trains a WordPiece tokenizer on the training text; a folder or Hub id uses
    that pretrained tokenizer. Either way `tokenizer` is then a `tokenizers.Tokenizer`, and
    `sep_id` (between documents), `mask_id` (None where a pretrained one has no mask token),
    `pad_id` (blocks are never padded: for models that ask) and `vocab_size` are its ids."""

    kind = "text"
    objective = "mlm"  # a causal LM asks for "causal": labels are the tokens, nothing masked

    def __init__(
        self,
        raw: datasets.DatasetDict,
        *,
        seed: int,
        vocab_size: int,
        batch_size: int,
        seq_len: int,
        mlm_probability: float,
        validation_fraction: float,
        num_workers: int,
        cache_dir: str,
        tokenizer: str | None = None,
    ):
        if seq_len < 8:
            raise UserError(f"dataset.seq_len={seq_len} is invalid: must be ≥ 8")
        if batch_size < 1:
            raise UserError(f"dataset.batch_size={batch_size} is invalid: must be ≥ 1")
        if not 0 < mlm_probability < 1:
            raise UserError(
                f"dataset.mlm_probability={mlm_probability} is invalid: must be in (0, 1)"
            )
        self.seed, self.batch_size, self.seq_len = seed, batch_size, seq_len
        self.mlm_probability, self.num_workers = mlm_probability, num_workers
        self.tokenizer_name = tokenizer
        raw = raw.filter(lambda row: isinstance(row["text"], str) and len(row["text"].strip()) > 0)
        if "validation" not in raw and validation_fraction > 0 and len(raw["train"]) > 1:
            raw = raw["train"].train_test_split(test_size=validation_fraction, seed=seed)
            raw["validation"] = raw.pop("test")
        if tokenizer is None:
            cache = Path(os.path.expanduser(cache_dir))
            self.tokenizer = train_tokenizer(raw["train"], vocab_size, cache)
            self.vocab_size = self.tokenizer.get_vocab_size()
            self.sep_id, self.mask_id, self.pad_id = SEP_ID, MASK_ID, PAD_ID
            self.replacement_ids = np.arange(len(SPECIAL_TOKENS), self.vocab_size)
        else:
            self._use_pretrained(tokenizer)
        tok_hash = _digest(self.tokenizer.to_str(), self.sep_id, seq_len)
        self.splits = {
            name: self._blocks(split, tok_hash).with_format("numpy") for name, split in raw.items()
        }
        if self.split_size("train") == 0:
            raise UserError(f"dataset: the training text has fewer than seq_len={seq_len} tokens")

    def _use_pretrained(self, name: str) -> None:
        hf = load_pretrained_tokenizer(name)
        self.tokenizer, self.vocab_size = hf.backend_tokenizer, len(hf)
        sep = hf.sep_token_id if hf.sep_token_id is not None else hf.eos_token_id
        if sep is None:
            raise UserError(
                f"dataset.tokenizer={name!r} has neither a sep nor an eos token "
                "to separate documents with"
            )
        self.sep_id, self.mask_id = sep, hf.mask_token_id
        self.pad_id = hf.pad_token_id
        # Random replacements (the 10%) are ordinary tokens, never [CLS], <s> or padding.
        self.replacement_ids = np.setdiff1d(np.arange(self.vocab_size), hf.all_special_ids)

    def _blocks(self, split: datasets.Dataset, tok_hash: str) -> datasets.Dataset:
        tokenizer, seq_len, sep_id = self.tokenizer, self.seq_len, self.sep_id

        def to_blocks(rows):
            ids: list[int] = []
            for enc in tokenizer.encode_batch(rows["text"], add_special_tokens=False):
                ids += enc.ids + [sep_id]
            usable = len(ids) // seq_len * seq_len
            return {"input_ids": [ids[i : i + seq_len] for i in range(0, usable, seq_len)]}

        return split.map(
            to_blocks,
            batched=True,
            batch_size=2000,
            remove_columns=split.column_names,
            new_fingerprint=_digest(split._fingerprint, tok_hash),
        )

    def split_size(self, split: str) -> int:
        return len(self.splits[split]) if split in self.splits else 0

    def use_objective(self, objective: str) -> None:
        """ "mlm" (the default) or "causal"; MLM needs a mask token."""
        if objective == "mlm":
            self._require_mask()
        self.objective = objective

    def _require_mask(self) -> None:
        if self.mask_id is None:
            raise UserError(
                f"dataset.tokenizer={self.tokenizer_name!r} has no mask token, so it cannot "
                "serve masked-language modelling: use a causal model or another tokenizer"
            )

    def collate(self, split: str, keys: list[tuple[int, int, int]]) -> Batch:
        ids = np.array(self.splits[split][[k[2] for k in keys]]["input_ids"], dtype=np.int64)
        if self.objective == "causal":
            return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(ids.copy())}
        self._require_mask()  # an MLM model need not have called use_objective
        labels = np.full_like(ids, IGNORE_INDEX)
        for row, key in zip(range(len(ids)), keys, strict=True):
            rng = sample_rng(self.seed, *key)
            chosen = rng.random(self.seq_len) < self.mlm_probability
            action = rng.random(self.seq_len)
            random_ids = self.replacement_ids[
                rng.integers(0, len(self.replacement_ids), self.seq_len)
            ]
            labels[row, chosen] = ids[row, chosen]
            ids[row] = np.where(chosen & (action < 0.8), self.mask_id, ids[row])
            ids[row] = np.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, ids[row])
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}

    def describe(self) -> dict:
        return super().describe() | {"seq_len": self.seq_len, "vocab_size": self.vocab_size}


class TextFiles(TextCorpus):
    """`dataset=text_files dataset.data_files=PATH_OR_GLOB`: text (one document per line), json,
    csv or parquet files (`dataset.format`), documents in `dataset.text_column`."""

    def __init__(
        self, data_files, validation_files=None, format="text", text_column="text", **kwargs
    ):
        if format not in ("text", "json", "csv", "parquet"):
            raise UserError(
                f"dataset.format={format!r} is invalid: allowed: text, json, csv, parquet"
            )
        files = {"train": _expand("dataset.data_files", data_files)}
        if validation_files:
            files["validation"] = _expand("dataset.validation_files", validation_files)
        load = {"path": format, "data_files": files}
        raw = load_text(
            "dataset.data_files", load, text_column, {"train": "train", "validation": "validation"}
        )
        super().__init__(raw, **kwargs)


class HubText(TextCorpus):
    """`dataset=hub_text dataset.path=NAME [dataset.name=CONFIG]`: a Hugging Face Hub dataset, on a
    machine that is online; the same loading path as local files."""

    def __init__(
        self,
        path: str,
        name=None,
        train_split="train",
        validation_split="validation",
        text_column="text",
        **kwargs,
    ):
        load = {"path": path, "name": name}
        raw = load_text(
            "dataset.path",
            load,
            text_column,
            {"train": train_split, "validation": validation_split},
        )
        super().__init__(raw, **kwargs)


class GeneratedText(TextCorpus):
    """A corpus written from the seed (see `generate_corpus`): a masked word is predictable from
    its context, so the MLM loss falls far below the unigram entropy, unlike random tokens."""

    def __init__(
        self,
        num_documents: int,
        words_per_document: int,
        vocab_words: int,
        num_topics: int,
        **kwargs,
    ):
        cache = Path(os.path.expanduser(kwargs["cache_dir"]))
        params = (kwargs["seed"], num_documents, words_per_document, vocab_words, num_topics)
        folder = cache / "corpus" / _digest("topic-markov-v2", *params)
        paths = {split: folder / f"{split}.txt" for split in ("train", "validation")}
        if not all(p.exists() for p in paths.values()):
            train, val = generate_corpus(*params, validation_fraction=kwargs["validation_fraction"])
            _atomic_write(paths["validation"], val)
            _atomic_write(paths["train"], train)
        files = {split: [str(p)] for split, p in paths.items()}
        load = {"path": "text", "data_files": files}
        raw = load_text("dataset", load, "text", {"train": "train", "validation": "validation"})
        super().__init__(raw, **kwargs)


def generate_corpus(
    seed: int,
    num_documents: int,
    words_per_document: int,
    vocab_words: int,
    num_topics: int,
    validation_fraction: float,
) -> tuple[str, str]:
    """(train text, validation text), one document per line, from one fixed language: each
    document keeps to one topic (a few dozen of the words), and within a topic each word has four
    likely successors. Context therefore tells a masked word twice over: by topic (learnt fast,
    from any position) and by its neighbours (learnt once positions are)."""
    rng = np.random.default_rng([seed, 7])
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words: list[str] = []
    while len(words) < vocab_words:
        w = "".join(rng.choice(syllables, size=rng.integers(1, 4)))
        if w not in words:
            words.append(w)
    topic_size = max(4, vocab_words // num_topics)
    topics = [
        rng.choice(vocab_words, size=min(topic_size, vocab_words), replace=False)
        for _ in range(num_topics)
    ]
    start_cdf = np.cumsum(1.0 / np.arange(1, topic_size + 1))
    start_cdf /= start_cdf[-1]
    successors = [np.stack([rng.choice(len(t), size=4, replace=False) for _ in t]) for t in topics]
    succ_cdf = np.cumsum([0.7, 0.2, 0.07, 0.03])

    def document(doc_rng: np.random.Generator) -> str:
        topic = int(doc_rng.integers(num_topics))
        vocab, succ = topics[topic], successors[topic]
        draws = doc_rng.random((words_per_document, 2))
        out, word = [], int(np.searchsorted(start_cdf, draws[0, 0]))
        for i in range(words_per_document):
            out.append(words[vocab[word]])
            if draws[i, 1] < 1 / 12:  # sentence end: the next word starts afresh
                out.append(".")
                word = int(np.searchsorted(start_cdf, draws[i, 0]))
            else:
                word = int(succ[word, min(np.searchsorted(succ_cdf, draws[i, 0]), 3)])
        return " ".join(out)

    n_val = max(1, round(num_documents * validation_fraction))
    docs = [document(np.random.default_rng([seed, 8, i])) for i in range(num_documents + n_val)]
    return "\n".join(docs[n_val:]) + "\n", "\n".join(docs[:n_val]) + "\n"


def check_transformer(
    data: DataModule,
    model: str,
    width: tuple[str, int],
    heads: tuple[str, int],
    positions: tuple[str, int],
) -> None:
    """A text transformer's shape checks: text data, heads dividing the width, blocks that fit."""
    require_kind(data, "text", model)
    (width_key, w), (heads_key, h), (positions_key, p) = width, heads, positions
    if w % h:
        raise UserError(
            f"model.{width_key}={w} is invalid: must be a multiple of model.{heads_key}={h}"
        )
    if data.seq_len > p:
        raise UserError(
            f"dataset.seq_len={data.seq_len} is invalid: must be ≤ model.{positions_key}={p}"
        )
