"""Running a docs block's commands as written, in a folder of its own, with the table's sizes."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT, Block
from tests.docs.table import COMMANDS, Entry

ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=(\"[^\"]*\"|'[^']*'|\S*)$")


def marks(block: Block) -> list:
    """The block's own marks (`<!--pytest.mark.NAME-->` above it, pytest-codeblocks reads them),
    and `slow` where a command of it is (the table)."""
    found = [eval(m, {"pytest": pytest}) for m in block.marks]  # as pytest-codeblocks does
    if any(COMMANDS.get(c.text, Entry()).slow for c in block.commands()):
        found.append(pytest.mark.slow)
    return found


def script(entry: Entry, text: str, folder: Path) -> str:
    """The shell the test runs for one command: its setup, then the command with the table's
    placeholders filled and its sizes appended (or the table's dry check instead)."""
    fill = {"{repo}": str(ROOT), "{tmp}": str(folder)}

    def filled(s: str) -> str:
        for k, v in fill.items():
            s = s.replace(k, v)
        return s

    if entry.dry:
        return filled(entry.dry)
    for old, new in entry.replace:
        text = text.replace(old, filled(new))
    command = f"{text} {entry.size}".strip()
    return f"{filled(entry.setup)}\n{command}" if entry.setup else command


def environment(entry: Entry, folder: Path, extra: dict | None = None) -> dict:
    """The suite's environment (offline, its caches: tests/conftest.py), this venv's `python`
    first on PATH, plus the table's variables for the command."""
    env = {**os.environ, **(extra or {})}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env.pop("PYTHONPATH", None)  # nothing beside what the docs say
    for key, value in entry.env.items():
        value = value.replace("{repo}", str(ROOT)).replace("{tmp}", str(folder))
        if value:
            env[key] = value
        else:
            env.pop(key, None)
    return env


def run_block(block: Block, folder: Path, extra_env: dict | None = None) -> None:
    """Each command of the block in turn, in `folder`; each must end with the status the docs
    show (0 unless a console block's `echo $?` says otherwise, or the table's `status`)."""
    folder.mkdir(parents=True, exist_ok=True)
    assigned: list[str] = []  # a block's `NAME="..."` lines, for the commands after them
    for command in block.commands():
        entry = COMMANDS[command.text]
        shell = script(entry, command.text, folder)
        if ASSIGNMENT.match(command.text):
            assigned.append(command.text)
            continue
        shell = "\n".join([*assigned, shell])
        proc = subprocess.run(
            ["bash", "-c", shell],
            cwd=folder,
            env=environment(entry, folder, extra_env),
            capture_output=True,
            text=True,
            timeout=900,
        )
        want = 0 if entry.dry else (command.status if entry.status is None else entry.status)
        assert proc.returncode == want, (
            f"{block.id}: `{command.text}` exited {proc.returncode}, not {want}\n"
            f"ran: {shlex.quote(shell)}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
        )
