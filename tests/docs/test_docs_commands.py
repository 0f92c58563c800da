"""Every shell command in README.md and docs/*.md runs as written (issue 51), in a folder of its
own, at the size tests/docs/table.py appends; every YAML block is run by a test (the table's
YAML_BLOCKS). The blocks are found by pytest-codeblocks (tests/docs/blocks.py). A block marked
`<!--pytest.mark.cluster-->` runs in tests/cluster/test_docs_cluster.py (make test-cluster), one
marked `<!--pytest.mark.gpu-->` where CUDA is (scripts/gpu_check.sh runs this file's
pytest.mark.gpu blocks); the rest here, `slow` ones in make test-slow."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.docs.blocks import LOOKS_LIKE_A_COMMAND, ROOT, SHELL, blocks, shell_blocks
from tests.docs.run import ASSIGNMENT, environment, marks, run_block, script
from tests.docs.table import COMMANDS, YAML_BLOCKS, Entry

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


# The runner's entry points whose arguments are the runner's config (`python -m runner.compare`
# and `.export` take folders): what follows the entry point is composed and validated
RUNNER = re.compile(
    r"^(?:[A-Za-z_]+=\S+ )*(?:python -m runner(?:\.(?:recipe|islands|project))?"
    r"|torchrun (?:--\S+ )*-m runner) (?P<args>.*)$"
)


def _runner_commands():
    """Every docs command that starts the runner (`python -m runner`, `.recipe`, `.islands`,
    `.project`, `torchrun ... -m runner`), outside GPU blocks, with its block's assignments."""
    for b in LOCAL:
        if "pytest.mark.gpu" in b.marks:
            continue
        assigned = [c.text for c in b.commands() if ASSIGNMENT.match(c.text)]
        for c in b.commands():
            e = COMMANDS.get(c.text)
            if e and not e.dry and RUNNER.match(c.text):
                yield pytest.param(c.text, e, assigned, id=f"{b.id}:{c.text[:60]}")


def _args(command: str, entry, assigned: list[str], folder) -> tuple[dict, list[str]]:
    """The command's variables (`NAME=value python ...`) and config arguments as the shell hands
    them over: the table's replacements and sizes, the block's `NAME="..."` expanded, `-m`
    dropped (preflight expands sweeps)."""
    text = script(Entry(entry.size, replace=entry.replace), command, folder)
    for line in assigned:
        name, _, value = line.partition("=")
        text = text.replace(f"${name}", shlex.split(value)[0])
    head, args = text[: RUNNER.match(text).start("args")], RUNNER.match(text)["args"]
    env = dict(w.split("=", 1) for w in shlex.split(head) if ASSIGNMENT.match(w))
    return env, [a for a in shlex.split(args) if a not in ("-m", "--multirun")]


@pytest.mark.parametrize("command, entry, assigned", list(_runner_commands()))
def test_docs_runner_commands_compose(command, entry, assigned, tmp_path, monkeypatch):
    """Quick, in make test: each docs command that starts the runner, with its sizes (and what
    the table's `setup` and `env` give it), passes the runner's own checks (every key and option
    exists, every job composes and validates), in process; a renamed key fails here before the
    slow run would."""
    from runner.config.commandline import normalized
    from runner.config.preflight import preflight

    monkeypatch.chdir(tmp_path)
    env = environment(entry, tmp_path)
    if entry.setup:
        subprocess.run(
            ["bash", "-c", script(Entry(setup=entry.setup), "true", tmp_path)],
            cwd=tmp_path,
            env=env,
            check=True,
            capture_output=True,
            timeout=300,
        )
    variables, args = _args(command, entry, assigned, tmp_path)
    for key in entry.env:
        if key in env:
            variables[key] = env[key]
    for key, value in variables.items():
        if key == "PYTHONPATH":
            for path in reversed(value.split(os.pathsep)):
                monkeypatch.syspath_prepend(path)
                _forget_packages_in(path, monkeypatch)  # another test's `mypkg` is not this one
        else:
            monkeypatch.setenv(key, value)
    preflight(normalized(args))


def _forget_packages_in(path: str, monkeypatch) -> None:
    """Modules imported from the folder's packages, dropped from sys.modules for this test only
    (the commands' `mypkg` is a different package in each)."""
    if Path(path).resolve() == ROOT:
        return  # the runner and the tests themselves: this process's own
    names = {p.name for p in Path(path).iterdir() if (p / "__init__.py").is_file()}
    for module in [m for m in sys.modules if m.split(".")[0] in names]:
        monkeypatch.delitem(sys.modules, module)


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
