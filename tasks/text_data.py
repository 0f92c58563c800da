"""Loading and tokenizers for the text tasks: local files or Hub datasets through Hugging Face
`datasets`, a WordPiece tokenizer trained on the training text (and cached), or a pretrained one."""

from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from runner.errors import UserError, first_line

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# The trained WordPiece vocabulary's special tokens; a pretrained tokenizer brings its own ids.
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD_ID, SEP_ID, MASK_ID = 0, 3, 4

datasets.disable_progress_bars()
datasets.logging.set_verbosity_error()


def _atomic_write(path: Path, text: str) -> None:
    """Parallel jobs may build the same cache entry; each writes a private file and renames it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _expand(key: str, patterns: str | list[str]) -> list[str]:
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    if not patterns:
        raise UserError(f"{key} is empty: give one or more text files or glob patterns")
    files: list[str] = []
    for pattern in patterns:
        found = sorted(glob.glob(os.path.expanduser(str(pattern))))
        if not found:
            raise UserError(f"{key}: no file found at {pattern!r}")
        files += [str(Path(f).resolve()) for f in found]
    for f in files:
        if not os.path.isfile(f) or not os.access(f, os.R_OK):
            raise UserError(f"{key}: {f!r} is not a readable file")
        if os.path.getsize(f) == 0:
            raise UserError(f"{key}: {f!r} is empty")
    return files


def train_tokenizer(texts: datasets.Dataset, vocab_size: int, cache_dir: Path) -> Tokenizer:
    """A WordPiece tokenizer (BERT-style normalisation) trained on the `text` column, cached by the
    dataset's fingerprint (which follows the files' content)."""
    path = cache_dir / "tokenizers" / f"wordpiece-{_digest(texts._fingerprint, vocab_size)}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    batches = (texts[i : i + 1000]["text"] for i in range(0, len(texts), 1000))
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS)
    tok.train_from_iterator(batches, trainer, length=len(texts))
    _atomic_write(path, tok.to_str())
    return tok


def load_pretrained_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """`AutoTokenizer.from_pretrained(name)` (a local folder or a Hub id), fast, with truncation and
    padding off in its backend: a saved tokenizer.json may carry them, and they would cut documents
    silently."""
    from transformers import AutoTokenizer  # slow to import: only where a run asks for it

    path = os.path.expanduser(name)
    # A missing folder would reach the Hub client, whose complaint is about repo id syntax.
    if name.startswith(("/", ".", "~")) and not os.path.isdir(path):
        raise UserError(f"dataset.tokenizer={name!r} cannot be loaded: no such directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # offline Hub, a folder without tokenizer files: one line
        cause = first_line(e).rstrip()
        if cause.endswith(":"):  # what follows is the story (e.g. what it tried): keep it all
            cause = " ".join(str(e).split())
        raise UserError(f"dataset.tokenizer={name!r} cannot be loaded: {cause}") from None
    if not tokenizer.is_fast:
        raise UserError(
            f"dataset.tokenizer={name!r} is a slow (Python) tokenizer: a fast one is needed"
        )
    tokenizer.backend_tokenizer.no_truncation()
    tokenizer.backend_tokenizer.no_padding()
    return tokenizer


def tokenizer_identity(tokenizer: PreTrainedTokenizerFast) -> str:
    """What a tokenized cache entry depends on. Taken right after loading: encoding with
    `truncation=True` rewrites the backend's settings, and so its serialisation."""
    return _digest(type(tokenizer).__name__, tokenizer.backend_tokenizer.to_str())


def load_splits(source: str, load: dict, splits: dict[str, str]) -> datasets.DatasetDict:
    """`datasets.load_dataset(**load)`, the same path for local files and Hub datasets, with the
    splits renamed ours ← theirs: "train" (required) and "validation" (where there is one)."""
    try:
        loaded = datasets.load_dataset(**load)
    except Exception as e:  # offline Hub, unreadable or malformed files: one line
        first = first_line(e)
        raise UserError(f"{source}: cannot load {load['path']!r}: {first}") from None
    picked = {ours: loaded[theirs] for ours, theirs in splits.items() if theirs in loaded}
    if "train" not in picked:
        raise UserError(
            f"{source}: {load['path']!r} has no split {splits['train']!r} (it has: {', '.join(loaded)})"
        )
    return datasets.DatasetDict(picked)


def require_column(key: str, column: str, table: datasets.Dataset, source: str) -> None:
    """A config key naming a column the data lacks is one line naming the columns there are."""
    if column not in table.column_names:
        raise UserError(
            f"{key}={column!r} is not a column of {source!r} "
            f"(columns: {', '.join(table.column_names)})"
        )


def load_text(
    source: str, load: dict, text_column: str, splits: dict[str, str]
) -> datasets.DatasetDict:
    """`load_splits`, with one column, "text"."""
    picked = load_splits(source, load, splits)
    for split in picked.values():
        require_column("dataset.text_column", text_column, split, load["path"])
    texts = picked.select_columns([text_column])
    return texts.rename_column(text_column, "text") if text_column != "text" else texts
