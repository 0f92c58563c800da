"""Review of issue 51 (the docs run as written): what an independent try at breaking it found.
Each test was red before its fix and is green after."""

from __future__ import annotations

import re

import pytest

from tests.docs.blocks import Block, shell_blocks
from tests.docs.table import COMMANDS

# --- python -m runner.project: bad input is one line, as in python -m runner ------------------


@pytest.mark.parametrize(
    "args, says",
    [
        (["model=gpt", "runner.project_precisionz=[bf16,fp8]"], "project_precisionz"),
        (["model=gpt", "runner.project=[H100]", "runner.project_precisions=[bf16,fp9]"], "fp9"),
        (["model=gpt", "trainer.max_steps=-5"], "trainer.max_steps=-5 is invalid"),
    ],
    ids=["misspelt-key", "unknown-precision", "negative-steps"],
)
def test_runner_project_refuses_bad_input_in_one_line(args, says, capsys, tmp_path, monkeypatch):
    """docs/projection.md's command with one value changed (a key misspelt, a precision that
    does not exist, a negative step count) is one error line and exit 2, before any audit; it
    was a 60-line Hydra traceback and exit 1 (the key, the precision), or ran on regardless
    (the steps, which preflight refuses for python -m runner)."""
    from runner.project import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and says in err, err
    assert "Traceback" not in err


# --- make test composes every docs command that starts the runner -----------------------------

STARTS_THE_RUNNER = re.compile(r"\b(python -m runner(\.(recipe|islands|project))?|-m runner) ")


def test_every_docs_command_that_starts_the_runner_is_composed_in_make_test():
    """A renamed key in any docs command that starts the runner (`python -m runner`,
    `.recipe`, `.islands`, `.project`, `torchrun -m runner`, one with a package of the reader's
    on PYTHONPATH) turns make test red, not only make test-slow: each is in the quick compose
    check. Before, only plain `python -m runner` commands without the table's setup or env
    were: `runner.project_precisions` renamed in docs/projection.md left make test green."""
    from tests.docs.test_docs_commands import _runner_commands

    composed = {p.values[0] for p in _runner_commands()}
    starting = {
        c.text
        for b in shell_blocks()
        if not {"pytest.mark.gpu", "pytest.mark.cluster"} & set(b.marks)
        for c in b.commands()
        if STARTS_THE_RUNNER.search(c.text) and not COMMANDS[c.text].dry
    }
    assert starting - composed == set()
    assert len(starting) >= 20


# --- a recipe file anywhere in the docs is run, not only in precision-modes.md's section -------


def test_a_recipe_file_outside_the_recipes_section_is_run(monkeypatch):
    """YAML_BLOCKS says a docs YAML block whose first line is `rules:` is run by
    tests/test_recipe.py's docs test: one in another page (docs/lora.md here) must be among what
    that test runs. Before, the test read only precision-modes.md's Recipes section, so a
    `rules:` block with a misspelt key elsewhere kept the suite green."""
    from tests.docs import blocks as docs
    from tests.test_recipe import docs_recipe_files

    stray = Block(
        "docs/lora.md", 99, "yaml", "rules:\n  - {modul: net.blocks.*, forwrd: bf16}\n", ()
    )
    real = docs.blocks()
    monkeypatch.setattr(docs, "blocks", lambda: (*real, stray))
    assert stray.code in docs_recipe_files()
    assert all(b.code in docs_recipe_files() for b in real if b.code.startswith("rules:"))


# --- a training run's runner.project is checked before it trains ------------------------------


def test_a_training_runs_projection_is_checked_before_it_trains(tmp_path, monkeypatch):
    """docs/projection.md's `python -m runner precision=bf16 model=bert runner.project=[H100]`
    with the GPU misspelt (or a precision that does not exist) is refused before the first
    step, as `python -m runner.project` refuses it; it trained the whole run first (minutes at
    the docs' size) and only then failed. The precision by the checks of every command line,
    the GPU by the run before anything is written (its names are the projection's)."""
    from runner.config.preflight import preflight
    from runner.errors import UserError
    from runner.run import run
    from tests.helpers import TINY_MLP, make_cfg

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=re.escape("fp9")):
        preflight(["precision=bf16", "model=bert", "runner.project_precisions=[fp9]"])
    cfg = make_cfg(*TINY_MLP, "runner.project=[H1000]", f"cache_dir={tmp_path / 'cache'}")
    with pytest.raises(UserError, match=re.escape("no GPU 'H1000'")):
        run(cfg, tmp_path / "run")
    left = {p.name for p in (tmp_path / "run").iterdir()}
    assert not left & {"metrics.jsonl", "run.json", "checkpoints", "summary.json"}, left
