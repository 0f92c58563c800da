"""Run-output files written whole or not at all, and read back whole: a reader, a resume or a
comparison after a kill sees the previous file or the new one, never half of one."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TMP_SUFFIX = ".tmp"  # a file being written: .<name>.<pid>.tmp beside its final name


@contextmanager
def replacing(path: Path, mode: str = "w", durable: bool = False) -> Iterator:
    """A file object whose content becomes `path` when the block ends, by a rename in the same
    folder; nothing of it where the block fails. `durable`: fsync before the rename (a file a
    resume depends on: a checkpoint), so a power loss cannot leave the new name on old blocks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    with replacing(path) as f:
        f.write(text)


def remove_stale(folder: Path) -> list[Path]:
    """The temporary files a killed writer left in `folder` (and its checkpoints/), removed; call
    only while holding the folder's lock, when no writer of ours can be using them."""
    stale = [
        p
        for d in (folder, folder / "checkpoints")
        if d.is_dir()
        for p in d.glob(f".*{TMP_SUFFIX}")
        if p.is_file()
    ]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def read_rows(path: Path) -> tuple[list[dict], int]:
    """The JSON rows of a JSON-lines file (metrics.jsonl), and where they end: the byte offset
    after the last whole row. A line a kill tore (the last one, cut mid-write) and whatever
    follows it are not rows: the offset says where the good part ends."""
    rows: list[dict] = []
    good = 0
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return rows, 0
    for line in data.splitlines(keepends=True):
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError:
                break
            if not isinstance(row, dict) or not line.endswith(b"\n"):
                break
            rows.append(row)
        good += len(line)
    return rows, good


def read_json(path: Path):
    """A JSON file's value; None where it is missing; ValueError where it cannot be read whole."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(str(e)) from None
