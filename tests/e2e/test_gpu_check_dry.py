"""scripts/gpu_check.sh's dry run (GPU_CHECK_DRY=1): every step of the GPU check on this CPU at
tiny sizes, from a fresh venv that imitates the GPU image and gets the rest from the wheel folder
with `pip install --no-index`, so the one call on a lent GPU has been run before."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
# A stable place, so a rerun needs no download (scripts/gpu_wheels.sh keeps what is up to date)
WHEELS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "amp-runner"
WHEELS = WHEELS / f"gpu-wheels-py{PYTHON}"
BERT_MODES = ["fp32", "tf32", "fp16", "bf16", "fp8", "bf16_true"]
GPT2_MODES = ["bf16", "fp8"]


def _unavailable(why: str) -> None:
    """What this machine lacks (PyPI, venv, the torch build) skips here, and fails under CI."""
    if os.environ.get("CI") == "true":
        pytest.fail(why)
    pytest.skip(why)


def _rows(table: str) -> dict[tuple[str, str], dict[str, str]]:
    """The per-precision table of table.md, by (run, precision)."""
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    start = next(i for i, line in enumerate(lines) if line.startswith("| run |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = [
        dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        for line in lines[start + 1 :]
    ]
    return {(r["run"], r["precision"]): r for r in rows}


def test_the_dry_run_installs_from_the_folder_runs_every_step_and_prints_the_table(tmp_path):
    env = {**os.environ, "GPU_PY_VERSION": PYTHON, "PY": sys.executable}
    wheels = subprocess.run(
        ["bash", "scripts/gpu_wheels.sh", str(WHEELS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if wheels.returncode != 0:
        _unavailable(f"no gpu wheels (PyPI?): {wheels.stderr.strip().splitlines()[-1:]}")
    assert not [w.name for w in WHEELS.glob("*.whl") if re.match(r"(torch|nvidia|triton)-", w.name)]
    # The image imitated: this environment's versions, so its packages come from pip's cache
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, check=True
    ).stdout
    pins = tmp_path / "image-pins.txt"
    pins.write_text("\n".join(p for p in freeze.splitlines() if re.match(r"[\w.-]+==", p)))
    results, work = tmp_path / "results", tmp_path / "work"
    env.update(
        GPU_CHECK_DRY="1",
        GPU_WHEELS=str(WHEELS),
        GPU_CHECK_PYTHON=getattr(sys, "_base_executable", sys.executable),
        GPU_CHECK_TORCH=f"torch=={torch.__version__}",
        GPU_CHECK_IMAGE_PINS=str(pins),
        GPU_CHECK_WORK=str(work),
    )
    env.pop("PY")
    try:
        proc = subprocess.run(
            ["bash", "scripts/gpu_check.sh", str(results)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        shutil.rmtree(work / "venv", ignore_errors=True)  # a torch install: gigabytes
    log = (results / "check.log").read_text() if (results / "check.log").exists() else ""
    if proc.returncode == 2 and "the image could not be imitated" in log:
        _unavailable("the fresh venv could not get torch and the image's packages")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

    # What comes back from the device machine: at most 8 files, no folders
    returned = sorted(p.name for p in results.iterdir())
    assert len(returned) <= 8 and all((results / n).is_file() for n in returned), returned
    assert {"check.log", "table.md", "compare-bert.md", "compare-gpt2.md"} <= set(returned)

    # The install took the folder's wheels, and nothing else: no index, no download
    install = log.split("=== install", 1)[1].split("=== install:", 1)[0]
    assert re.search(rf"pip install --no-index --find-links {re.escape(str(WHEELS))} ", install)
    assert "Downloading" not in install and "Successfully installed" in install
    for name in ("hydra-core", "omegaconf", "datasets", "torchao", "amp-runner"):
        assert re.search(rf"Successfully installed .*\b{name}-\d", install), name
    assert "=== install: passed" in log

    # Every step passed, and the table has every precision of every run, measured
    table = (results / "table.md").read_text()
    steps = ["install", "env", "tests", "bert", "gpt2", "projection", "ddp", "fsdp"]
    for name in steps:
        assert f"| {name} | passed |" in table, name
    rows = _rows(table)
    wanted = [("bert", m) for m in BERT_MODES] + [("gpt2", m) for m in GPT2_MODES]
    wanted += [("ddp", "bf16"), ("fsdp", "bf16")]
    assert sorted(rows) == sorted(wanted)
    for key in wanted:
        row = rows[key]
        assert row["status"] == "completed", key
        assert float(row["samples/s"]) > 0 and row["speedup"].endswith("×"), key
        assert float(row["peak memory MB"]) > 0, key
    for mode in BERT_MODES:  # projected for the GPU named, beside the measured step
        row = rows[("bert", mode)]
        assert "(H200 SXM)" in row["projected step"] and float(row["measured / projected"]) > 0
    assert rows[("bert", "fp32")]["speedup"] == "1.00×"
    assert "Measured on a CPU (the dry run" in table
    assert table in log and table.strip() in proc.stdout

    summaries = json.loads(gzip.decompress((results / "summaries.json.gz").read_bytes()))
    assert [s["precision_requested"] for s in summaries["bert"]] == BERT_MODES
    assert "| fp8 | H200 SXM |" in (results / "projection.md").read_text()
