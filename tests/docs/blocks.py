"""The code blocks of README.md and docs/*.md, found by pytest-codeblocks (its
`extract_from_file`: each block's text, line and language, and the pytest marks written above it
as `<!--pytest.mark.NAME-->`), and the shell commands in them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pytest_codeblocks import extract_from_file

ROOT = Path(__file__).resolve().parents[2]
SHELL = {"bash", "sh", "shell", "console"}
# An untagged block whose first line reads as a command: tag it ```bash (or console), so it runs
LOOKS_LIKE_A_COMMAND = re.compile(r"^(\$ )?([A-Z_]+=|(python|torchrun|make|bash|pip|sbatch)\b)")


@dataclass(frozen=True)
class Command:
    text: str  # as written, continuation lines joined (the table's key)
    status: int = 0  # the exit status the docs show (a console block's `echo $?`), else 0


@dataclass(frozen=True)
class Block:
    path: str  # README.md, docs/NAME.md
    line: int
    syntax: str
    code: str
    marks: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    def commands(self) -> list[Command]:
        return console_commands(self.code) if self.syntax == "console" else bash_commands(self.code)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@cache
def blocks() -> tuple[Block, ...]:
    found = []
    for path in documents():
        for b in extract_from_file(path):
            syntax = (b.syntax or "").strip()
            marks = tuple(m.strip() for m in b.marks)
            found.append(Block(str(path.relative_to(ROOT)), b.lineno, syntax, b.code, marks))
    return tuple(found)


def shell_blocks() -> list[Block]:
    return [b for b in blocks() if b.syntax in SHELL]


def _joined(lines: list[str]) -> list[str]:
    """Continuation lines (a trailing backslash) joined into one, single-spaced."""
    out, current = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1].strip() + " "
            continue
        out.append((current + line.strip()).strip())
        current = ""
    if current:
        out.append(current.strip())
    return out


def _uncommented(line: str) -> str:
    """A command without its trailing `# comment` (a # after a space, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def bash_commands(code: str) -> list[Command]:
    lines = [_uncommented(line) for line in code.splitlines()]
    return [Command(" ".join(c.split())) for c in _joined(lines) if c]


def console_commands(code: str) -> list[Command]:
    """`$ ` lines are commands (with their continuation lines); `$ echo $?` and the number
    after it are the status the command before it ends with; other lines are its output."""
    commands: list[Command] = []
    lines = code.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.startswith("$ "):
            continue
        text = [line[2:]]
        while text[-1].rstrip().endswith("\\") and i < len(lines):
            text.append(lines[i])
            i += 1
        (command,) = _joined([_uncommented(t) for t in text])
        if command == "echo $?" and commands and i < len(lines):
            commands[-1] = Command(commands[-1].text, int(lines[i].strip()))
            continue
        commands.append(Command(" ".join(command.split())))
    return commands
