"""summary.json's converted section (`converted`, `converted_flops_per_step`,
`converted_flop_share`) is also written under its old names (`fp8`, `fp8_flops_per_step`,
`fp8_flop_share`) for existing readers, and the comparison reads a run written before the rename,
which has only the old ones (runner/summary_aliases.py)."""

from __future__ import annotations

import json

import pytest

from runner.run import run
from tests.helpers import TINY_MLP, make_cfg

pytest.importorskip("torchao")


def test_summary_json_has_the_new_keys_and_the_old_ones_with_equal_values(tmp_path):
    """Both Linears of a tiny MLP converted to fp8 (no skip rule): the same section twice."""
    cfg = make_cfg(
        *TINY_MLP,
        "model.num_layers=1",
        "dataset.num_classes=16",
        "trainer.max_steps=2",
        "trainer.val_check_interval=0",
        "precision=fp8",
        "precision.fp8.skip=[]",
    )
    run(cfg, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    new, old = summary["converted"], summary["fp8"]
    assert new["converted"] == ["net.0", "net.3"] and new["converted_flops_per_step"] > 0
    assert old["fp8_flops_per_step"] == new["converted_flops_per_step"]
    assert old["fp8_flop_share"] == new["converted_flop_share"] > 0
    renamed = {"converted_flops_per_step", "converted_flop_share"}
    assert {k: v for k, v in new.items() if k not in renamed} == {
        k: v for k, v in old.items() if k not in ("fp8_flops_per_step", "fp8_flop_share")
    }


def test_the_comparison_reads_a_run_written_with_the_old_keys_only(tmp_path):
    """An older run's summary.json: `fp8` with `fp8_flop_share`, emulated kernels. Its row has
    its converted FLOP share, and its speed is called emulated, as a new run's would be."""
    from runner.compare import compare
    from tests.test_compare import fake_job

    old = {"converted": ["net.0"], "kernels": "emulated", "fp8_flop_share": 0.4}
    fake_job(tmp_path / "0", "bf16", speed=100.0)
    fake_job(tmp_path / "1", "fp8", speed=150.0, summary={"fp8": old})
    _, fp8 = compare(tmp_path, wandb_log=False)
    assert fp8.figures["converted_flop_share"] == pytest.approx(0.4)
    assert fp8.figures["speed_emulated_by"] == "converted"
    assert "speed emulated: its fp8 matmuls were emulated" in fp8.verdict
