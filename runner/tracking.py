"""Where metrics go: `metrics.jsonl` (always, the source of truth), `summary.json`, and the
configured tracker backend."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _jsonable(value):
    # JSON has no inf/NaN; a diverged loss is written as a string so the file stays valid.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class RunLog:
    """One run's metrics. Rows are written (and flushed) as they come, so a crash loses nothing
    that was logged."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(out_dir / "metrics.jsonl", "w", encoding="utf-8")

    def log_rows(self, rows: list[dict]) -> None:
        for row in rows:
            self._metrics.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")
        self._metrics.flush()

    def finish(self, summary: dict) -> None:
        self._metrics.close()
        text = json.dumps({k: _jsonable(v) for k, v in summary.items()}, indent=2)
        (self.out_dir / "summary.json").write_text(text + "\n")

    def close(self) -> None:
        if not self._metrics.closed:
            self._metrics.close()
