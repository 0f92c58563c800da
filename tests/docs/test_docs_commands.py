"""Every shell command in README.md and docs/*.md runs as written (issue 51), in a folder of its
own, at the size tests/docs/table.py appends; every YAML block is run by a test (the table's
YAML_BLOCKS). The blocks are found by pytest-codeblocks (tests/docs/blocks.py). A block marked
`<!--pytest.mark.cluster-->` runs in tests/cluster/test_docs_cluster.py (make test-cluster), one
marked `<!--pytest.mark.gpu-->` where CUDA is (scripts/gpu_check.sh runs this file's
pytest.mark.gpu blocks); the rest here, `slow` ones in make test-slow."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
import yaml

from tests.docs.blocks import LOOKS_LIKE_A_COMMAND, ROOT, SHELL, blocks, shell_blocks
from tests.docs.run import marks, run_block
from tests.docs.table import COMMANDS, YAML_BLOCKS

LOCAL = [b for b in shell_blocks() if "pytest.mark.cluster" not in b.marks]


def test_every_docs_command_has_an_entry():
    """A command the docs gain needs its size decided (tests/docs/table.py); an entry whose
    command the docs lost goes too."""
    written = {c.text: b.id for b in shell_blocks() for c in b.commands()}
    missing = [f"{where}: {text!r}" for text, where in written.items() if text not in COMMANDS]
    assert not missing, "add to COMMANDS in tests/docs/table.py:\n" + "\n".join(missing)
    assert not set(COMMANDS) - set(written), "no longer in the docs: drop from tests/docs/table.py"
    for text, entry in COMMANDS.items():
        if entry.replace or entry.setup or entry.env or entry.dry or entry.status is not None:
            assert entry.why, f"{text!r}: say why it cannot run as written (`why`)"


def test_every_block_that_reads_as_commands_is_tagged_so_it_runs():
    untagged = [
        b.id for b in blocks() if b.syntax not in SHELL and LOOKS_LIKE_A_COMMAND.match(b.code)
    ]
    assert not untagged, f"tag these ```bash (or ```console): {untagged}"


def test_the_only_marks_are_cluster_and_gpu():
    """Nothing is skipped but what needs the cluster or a GPU."""
    used = {m for b in blocks() for m in b.marks}
    assert used <= {"pytest.mark.cluster", "pytest.mark.gpu"}, used


def test_every_yaml_block_is_run_by_a_test():
    for b in blocks():
        if b.syntax not in ("yaml", "yml"):
            continue
        yaml.safe_load(b.code)
        first = b.code.splitlines()[0].strip()
        assert first in YAML_BLOCKS, (
            f"{b.id}: add its first line to YAML_BLOCKS with the test that runs it"
        )
        path, _, name = YAML_BLOCKS[first].partition("::")
        assert f"def {name}(" in (ROOT / path).read_text(), YAML_BLOCKS[first]


def _runner_commands():
    for b in LOCAL:
        if "pytest.mark.gpu" in b.marks:
            continue
        for c in b.commands():
            e = COMMANDS.get(c.text)
            if (
                e
                and not (e.dry or e.setup or e.env or e.replace)
                and c.text.startswith("python -m runner ")
            ):
                yield pytest.param(c.text, e.size, id=f"{b.id}:{c.text[:60]}")


@pytest.mark.parametrize("command, size", list(_runner_commands()))
def test_docs_runner_commands_compose(command, size, tmp_path, monkeypatch):
    """Quick, in make test: each plain `python -m runner` command of the docs, with its sizes,
    passes the runner's own checks (every key and option exists, every job composes and
    validates), in process; a renamed key fails here before the slow run would."""
    from runner.config.commandline import normalized
    from runner.config.preflight import preflight

    monkeypatch.chdir(tmp_path)
    args = shlex.split(f"{command} {size}")[3:]  # after `python -m runner`
    preflight(normalized(args))


def _local_blocks():
    """The shell blocks not marked cluster, and every ```python block (run as a script in its
    own folder, slow: it imports torch)."""
    for b in LOCAL:
        yield pytest.param(b, marks=marks(b), id=b.id)
    for b in blocks():
        if b.syntax == "python":
            yield pytest.param(b, marks=[pytest.mark.slow, *marks(b)], id=b.id)


@pytest.mark.parametrize("block", list(_local_blocks()))
def test_the_docs_blocks_run(block, tmp_path):
    if block.syntax == "python":
        (tmp_path / "block.py").write_text(block.code)
        proc = subprocess.run(
            [sys.executable, "block.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, f"{block.id}:\n{proc.stderr[-3000:]}"
        return
    run_block(block, tmp_path)


def test_a_renamed_key_in_a_docs_command_is_caught(tmp_path, monkeypatch):
    """The check above goes red for a docs command with a key renamed (as a docs edit would)."""
    from runner.config.commandline import with_seeds
    from runner.config.preflight import preflight
    from runner.errors import UserError

    monkeypatch.chdir(tmp_path)
    broken = re.sub(
        "init_scale", "init_scal", "precision=fp16 precision.grad_scaler.init_scale=1024"
    )
    with pytest.raises(UserError, match="init_scal"):
        preflight(with_seeds(shlex.split(broken)))
