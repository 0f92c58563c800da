"""A converting mode (fp8, mxfp8, nvfp4, mxfp4) that converted no Linear says so (issue 39): a
tiny MLP's two Linears are both skipped (the first and the last, fp8's default `skip`), so the
run is bf16 autocast by another name. Its summary, its projection (1.00× bf16) and the
comparison's verdict name the rule that skipped each Linear instead of a silent 1.00×."""

from __future__ import annotations

import pytest

from runner.run import run
from tests.helpers import TINY_MLP, make_cfg

pytest.importorskip("torchao")

# Linears 32 → 64 and 64 → 16 (net.0 and net.3): both multiples of 16, so the skip rule is the one
# that keeps each in bf16
TWO_LINEARS = [*TINY_MLP, "model.num_layers=1", "dataset.num_classes=16", "trainer.max_steps=3"]
RULES = ("net.0: the first Linear layer (precision.fp8.skip)", "net.3: the last Linear layer")


def test_an_fp8_run_whose_linears_are_all_skipped_says_so(tmp_path, capsys):
    cfg = make_cfg(
        *TWO_LINEARS,
        "precision=fp8",
        "trainer.val_check_interval=0",
        "runner.project=[H100]",
        "runner.project_precisions=[bf16]",
    )
    summary = run(cfg, tmp_path)
    fp8 = summary["converted"]
    assert fp8["converted"] == []
    words = fp8["nothing_converted"]
    assert words.startswith("converted no Linear") and all(rule in words for rule in RULES)
    row = summary["projection"]["H100 SXM"]["fp8"]
    assert row["speedup_vs_bf16"] == pytest.approx(1.0) and row["converted_linears"] == 0
    assert row["nothing_converted"] == f"fp8 {words}"
    out, err = capsys.readouterr()
    table = err[err.index("projected (an estimate") :]  # the run's console: stderr
    fp8_line = next(line for line in table.splitlines() if line.strip().startswith("H100 SXM  fp8"))
    assert "1.00×*" in fp8_line  # marked: the note under the table says why
    assert f"* fp8 {words}" in " ".join(table.split())
    # the run's own summary, at its end (stdout)
    assert f"next: fp8 {words}" in " ".join(out.split())


def test_min_features_and_skip_patterns_are_named_too(tmp_path):
    """Every Linear below precision.fp8.min_features, or matching a skip pattern: the words say
    which rule kept which Linears."""
    cfg = make_cfg(
        *TWO_LINEARS, "precision=fp8", "precision.fp8.skip=[net.0]", "precision.fp8.min_features=24"
    )
    words = run(cfg, tmp_path)["converted"]["nothing_converted"]
    assert "net.0: matches 'net.0' (precision.fp8.skip)" in words
    assert "net.3: smaller than precision.fp8.min_features=24" in words  # 64 → 16


def test_the_comparison_verdict_says_the_mode_converted_no_linear(tmp_path):
    from runner.compare import compare
    from tests.test_compare import fake_job

    words = "converted no Linear: net.0: the first Linear layer (precision.fp8.skip)"
    section = {"converted": [], "skipped": {"net.0": "…"}, "nothing_converted": words}
    fake_job(tmp_path / "0", "bf16", speed=100.0)
    fake_job(tmp_path / "1", "fp8", speed=100.0, summary={"converted": section})
    bf16, fp8 = compare(tmp_path, wandb_log=False)
    assert f"fp8 {words}" in fp8.verdict
    assert "converted no Linear" not in bf16.verdict


def test_python_m_runner_project_says_it_too():
    """`python -m runner.project` audits each precision in a throwaway trainer: its fp8 row
    carries the same words."""
    from runner.project import project_overrides

    projected = project_overrides(
        [*TWO_LINEARS, "runner.project=[H100]", "runner.project_precisions=[bf16,fp8]"]
    )["H100 SXM"]
    assert projected["fp8"]["speedup_vs_bf16"] == pytest.approx(1.0)
    words = projected["fp8"]["nothing_converted"]
    assert words.startswith("fp8 converted no Linear") and all(rule in words for rule in RULES)
    assert "nothing_converted" not in projected["bf16"]


def test_a_sweep_point_where_fp8_converted_nothing_is_never_its_crossover():
    """Where fp8 converted nothing its projected step is bf16's, give or take a cast: a 1.001×
    there is no crossover."""
    from runner.project import crossovers

    unconverted = {"speedup_vs_bf16": 1.001, "nothing_converted": "fp8 converted no Linear (…)"}
    points = [
        (["model.hidden_size=64"], {"H100 SXM": {"fp8": unconverted}}),
        (["model.hidden_size=1024"], {"H100 SXM": {"fp8": {"speedup_vs_bf16": 0.9}}}),
        (["model.hidden_size=4096"], {"H100 SXM": {"fp8": {"speedup_vs_bf16": 1.2}}}),
    ]
    [line] = crossovers(points, "model.hidden_size")
    assert line == (
        "H100 SXM: fp8 over bf16 (projected) passes 1.0× at model.hidden_size=4096 "
        "(64: no Linear converted, 1024: 0.90×, 4096: 1.20×)"
    )


def test_a_mode_that_converted_nothing_is_never_recommended_on_its_speed(tmp_path):
    """fp8 that converted no Linear ran as bf16: its speed (1.5× fp32's here) says nothing of
    fp8, and its verdict says why instead of recommending it."""
    from runner.compare import compare
    from tests.test_compare import fake_job

    words = "converted no Linear: net.0: the first Linear layer (precision.fp8.skip)"
    section = {"converted": [], "skipped": {"net.0": "…"}, "nothing_converted": words}
    fake_job(tmp_path / "0", "fp32", speed=100.0, summary={"mfu": 0.5})
    fake_job(tmp_path / "1", "fp8", speed=150.0, summary={"converted": section, "mfu": 0.5})
    _, fp8 = compare(tmp_path, wandb_log=False)
    assert "speed emulated: its fp8 converted no Linear, so it ran as bf16" in fp8.verdict
    assert "recommended" not in fp8.verdict.replace("not recommended", "")
