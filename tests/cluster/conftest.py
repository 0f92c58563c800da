"""The real cluster: the one-node SLURM and the Ray head that `scripts/cluster.sh up` starts on
127.0.0.1 (`make test-cluster` brings them up, runs `pytest -m cluster`, takes them down).

The fixtures read CLUSTER_DIR/env, which `up` writes (SLURM_CONF, RAY_ADDRESS, ...). Where the
cluster is not up, or this machine cannot host it, a test skips with one line saying why; under
CI=true that line is a failure instead: CI runs `make test-cluster` and must not pass by skipping.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

CLUSTER_DIR = Path(os.environ.get("CLUSTER_DIR", "/tmp/amp-runner-cluster"))
ENV_FILE = CLUSTER_DIR / "env"


def unavailable(reason: str) -> None:
    """Skip with `reason`; fail under CI=true, where the cluster tests must run."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: the cluster tests must run, not skip)", pytrace=False)
    pytest.skip(reason)


def read_env(path: Path) -> dict[str, str]:
    """CLUSTER_DIR/env: KEY='value' lines in shell syntax (`set -a; . env` reads it too)."""
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = " ".join(shlex.split(value))
    return env


def _why_no_cluster() -> str:
    if not sys.platform.startswith("linux"):
        return "the cluster tests need Linux (scripts/cluster.sh hosts SLURM and Ray here)"
    if not shutil.which("sbatch") and os.geteuid() != 0:
        return "SLURM is not installed and this user cannot host it: run `sudo bash scripts/cluster.sh up`"
    return f"the cluster is not up (no {ENV_FILE}): run `make test-cluster`, or `bash scripts/cluster.sh up` first"


def wait_until(check: Callable[[], object], timeout: float, what: str, interval: float = 0.2):
    """Poll `check` until it returns something true; its value. Fails naming `what` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s", pytrace=False)
        time.sleep(interval)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 300) -> str:
    """A sweep started in the background, waited for: its output (in `log`)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the sweep did not end in {timeout:.0f} s:\n{log.read_text()[-3000:]}")
    return log.read_text()


@pytest.fixture(scope="session")
def cluster_env() -> dict[str, str]:
    """The variables a client of the cluster needs (CLUSTER_DIR/env)."""
    if not ENV_FILE.is_file():
        unavailable(_why_no_cluster())
    return read_env(ENV_FILE)


@dataclass
class Slurm:
    """The SLURM commands, pointed at the test cluster (its SLURM_CONF)."""

    env: dict[str, str]
    partition: str

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=60)
        if check and proc.returncode:
            pytest.fail(f"{shlex.join(args)} failed: {proc.stderr.strip()}", pytrace=False)
        return proc

    def sbatch(self, *args: str) -> str:
        """Submit; the job id."""
        return (
            self.run("sbatch", "--parsable", f"--partition={self.partition}", *args)
            .stdout.strip()
            .split(";")[0]
        )

    def state(self, job: str) -> str:
        """The job's state as accounting (sacct) records it; '' until slurmdbd has it."""
        out = self.run("sacct", "-n", "-X", "-P", "-j", job, "-o", "State", check=False).stdout
        return out.strip().split(" ")[0] if out.strip() else ""


@pytest.fixture(scope="session")
def slurm(cluster_env) -> Slurm:
    """The cluster's SLURM, checked to answer: controller up, the node taking jobs, sacct."""
    if "SLURM_CONF" not in cluster_env:
        unavailable(f"{ENV_FILE} names no SLURM_CONF: run `bash scripts/cluster.sh up` again")
    if not shutil.which("sbatch"):
        unavailable("SLURM's commands are not installed here: run `bash scripts/cluster.sh up`")
    env = {**os.environ, **cluster_env}
    s = Slurm(env=env, partition=cluster_env.get("CLUSTER_PARTITION", "debug"))
    for args, answer in ((("scontrol", "ping"), "UP"), (("sinfo", "-h", "-o", "%t"), "")):
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
        out = (proc.stdout + proc.stderr).strip()
        if proc.returncode or answer not in out:
            unavailable(
                f"SLURM of {CLUSTER_DIR} is not answering (`{shlex.join(args)}`: {out.splitlines()[-1] if out else proc.returncode}): run `bash scripts/cluster.sh up`"
            )
    state = s.run("sinfo", "-h", "-o", "%t").stdout.split()
    if not any(st.rstrip("*~#") in ("idle", "mix", "alloc") for st in state):
        unavailable(
            f"the cluster's node takes no jobs (sinfo: {' '.join(state)}): see {CLUSTER_DIR}/log/slurmd.log"
        )
    if s.run("sacct", "-n", "-X", "-S", "now-1minutes", check=False).returncode:
        unavailable(f"sacct does not answer (slurmdbd): see {CLUSTER_DIR}/log/slurmdbd.log")
    return s


@pytest.fixture(scope="session")
def ray_head(cluster_env) -> Iterator[str]:
    """The Ray head's address, with the environment its clients need set in this process."""
    address = cluster_env.get("RAY_ADDRESS")
    if not address:
        unavailable(f"{ENV_FILE} names no RAY_ADDRESS: run `bash scripts/cluster.sh up` again")
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        unavailable(
            f"the Ray head at {address} is not answering ({e}): run `bash scripts/cluster.sh up`"
        )
    with pytest.MonkeyPatch.context() as mp:
        # Before ray is imported: it reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import time
        # (0 keeps 127.0.0.1 from being swapped for this machine's outward address).
        for key in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
            if key in cluster_env:
                mp.setenv(key, cluster_env[key])
        try:
            import ray  # noqa: F401
        except ImportError:
            unavailable(
                "Ray is not installed in this environment: pip install -e '.[ray]' (scripts/cluster.sh up installs it)"
            )
        yield address
