"""The cluster fixtures' own behaviour, which needs no cluster (so `make test` runs it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_unavailable_cluster_skips_with_a_reason_or_fails_in_ci(tmp_path):
    """Without CLUSTER_DIR/env the fixtures skip with one line; under CI=true they fail (an
    error in the fixture: pytest exits non-zero)."""
    test = tmp_path / "test_x.py"
    test.write_text("def test_needs_slurm(slurm):\n    pass\n")
    (tmp_path / "conftest.py").write_text(
        "from tests.cluster.conftest import cluster_env, slurm  # noqa: F401\n"
    )
    for ci, outcome, rc in (("", "1 skipped", 0), ("true", "1 error", 1)):
        env = {
            **os.environ,
            "CLUSTER_DIR": str(tmp_path / "none"),
            "CI": ci,
            "PYTHONPATH": str(ROOT),
        }
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-rs",
                "-p",
                "no:cacheprovider",
                "--rootdir",
                str(tmp_path),
                str(test),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert outcome in proc.stdout, proc.stdout
        assert proc.returncode == rc, proc.stdout
        assert "the cluster is not up" in proc.stdout, proc.stdout
