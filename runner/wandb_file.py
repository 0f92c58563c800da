"""An offline W&B run file read back (`run-<id>.wandb`, what `wandb sync` uploads): a resumed
run learns which of its steps W&B already holds, so that every step reaches it exactly once."""

from __future__ import annotations

import json
from pathlib import Path

_BLOCK = 32768  # the file is a LevelDB-style log of 32 KiB blocks


def records(path: Path) -> list:
    """The `wandb.proto` Records of a run file: each stored in one or more pieces, each piece
    behind a 7-byte header (crc32, length, type). A file cut short (its writer killed) gives the
    records before the cut."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    pos, pending, found = 7, b"", []
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        if (kind == 0 and length == 0) or pos + 7 + length > len(data):
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            try:
                record.ParseFromString(pending)
            except DecodeError:
                break
            found.append(record)
            pending = b""
    return found


def history(path: Path) -> list[dict]:
    """The history rows of a run file, in the order they were logged."""
    return [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records(path)
        if r.HasField("history")
    ]


def run_files(out_dir: Path, run_id: str) -> list[Path]:
    """The offline files of one W&B run in a run directory, oldest first: each attempt of a
    resumed run adds a folder `offline-run-<time>-<id>`, `-<id>-<n>` where a name is taken."""
    found = {}
    for path in Path(out_dir).glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb"):
        time, _, rest = path.parent.name.removeprefix("offline-run-").partition(f"-{run_id}")
        if not rest or rest[1:].isdigit():
            found[time, int(rest[1:] or 0)] = path
    return [found[key] for key in sorted(found)]


def last_step(out_dir: Path, run_id: str) -> int | None:
    """The highest `step` the run's offline files hold, None where they hold none."""
    steps = [
        row["step"]
        for path in run_files(out_dir, run_id)
        for row in history(path)
        if isinstance(row.get("step"), int)
    ]
    return max(steps, default=None)
