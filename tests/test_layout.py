"""The layout the README describes holds: runner/'s packages import only downwards (no cycle), no
file is over 300 lines and no class over 200. Read off the source, as a newcomer would."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parent.parent / "runner"
# Lowest first: a module may import its own layer and those before it. The entry points
# (runner/__main__.py, islands.py, export.py, doctor.py) sit above them all.
LAYERS = [
    (
        "runner.errors",
        "runner.files",
        "runner.summary_aliases",
        "runner.console",
        "runner.task",
        "runner.wandb_file",
        "runner.tracking",
        "runner.build",
    ),
    ("runner.precision",),
    ("runner.config",),
    ("runner.measure",),
    ("runner.train",),
    ("runner.folders", "runner.sweep_folder"),  # a job folder's and a sweep folder's rules
    ("runner.answers",),
    ("runner.compare",),
    ("runner.run",),
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    out = {}
    for path in RUNNER.rglob("*.py"):
        parts = path.relative_to(RUNNER.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path) -> set[str]:
    """The runner modules `path` imports at run time (anywhere in it; not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
        for node in ast.walk(branch)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("runner"):
            found |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("runner")}
    return found - {"runner"}  # the package itself (CONF_DIR, the schemas' registration)


def _layer(module: str) -> int | None:
    name = ".".join(module.split(".")[:2])
    return RANK.get(name)


def test_packages_import_only_downwards():
    modules = _modules()
    upward = []
    for name, path in modules.items():
        mine = _layer(name)
        if mine is None:
            continue  # an entry point
        for target in _imports(path) & modules.keys():
            theirs = _layer(target)
            if theirs is None or theirs > mine:
                upward.append(f"{name} imports {target}")
    assert not upward


def test_no_import_cycle():
    modules = _modules()
    graph = {n: (_imports(p) & modules.keys()) - {n} for n, p in modules.items()}
    # an import of a package runs its __init__: a module inside does not "import" its own package
    graph = {n: {d for d in deps if not n.startswith(d + ".")} for n, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in graph[node]:
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(dep) :] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])


def test_no_file_over_300_lines_and_no_class_over_200():
    long_files = {
        str(p.relative_to(RUNNER)): n
        for p in RUNNER.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 300
    }
    long_classes = {
        f"{p.relative_to(RUNNER)}:{node.name}": node.end_lineno - node.lineno + 1
        for p in RUNNER.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 200
    }
    assert not long_files and not long_classes


def test_the_config_package_imports_light():
    """The entry point checks a command line with runner.config before anything heavy loads
    (runner/config/__init__.py): importing it loads neither torch nor the console. A schema that
    imported runner.precision did both, and a spawned rank then made its console before its
    COLUMNS was set (tests/test_distributed.py's wrapped lines)."""
    code = (
        "import sys, runner.config; print('torch' in sys.modules, 'runner.console' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout
