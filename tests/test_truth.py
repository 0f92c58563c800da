"""Precision truth: the table of dtypes a run really holds, read off its tensors after the first
optimizer step, with every departure from what the config asked for named."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from runner.config import PrecisionConfig
from runner.measure.truth import precision_truth
from runner.precision import Precision
from runner.run import run
from tests.helpers import load_last, make_cfg, module_run
from tests.test_distributed import run_ranks

HERE = "tests.test_truth"


class NormNet(nn.Module):
    """Two blocks (FSDP's shard units) of a Linear and a LayerNorm, and a head."""

    def __init__(self, width: int = 16, features: int = 8, outputs: int = 3):
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Sequential(nn.Linear(features, width), nn.LayerNorm(width)),
            nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)),
        )
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        return self.head(self.blocks(x))


class HalfHeadNet(NormNet):
    """Someone's net that casts its head to bf16 itself."""

    def __init__(self):
        super().__init__()
        self.head.to(torch.bfloat16)


def net_run(*overrides: str, net: str = "NormNet") -> list[str]:
    return module_run(f"{HERE}.{net}", *overrides)


def truth_of(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())["precision_truth"]


def rows_of(truth: dict, module: str, prefix: str = "") -> list[dict]:
    rows = [r for r in truth["rows"] if r["module"] == module and r["example"].startswith(prefix)]
    assert rows, (module, prefix)
    return rows


def held(rows: list[dict], key: str) -> set:
    return {row[key] for row in rows}


@pytest.mark.parametrize(("mode", "autocast"), [("fp32", "off"), ("bf16", "bf16")])
def test_mixed_modes_hold_fp32_weights_grads_and_state(tmp_path, mode, autocast):
    summary = run(make_cfg(*net_run(f"precision={mode}")), tmp_path)
    truth = truth_of(tmp_path)
    assert truth == summary["precision_truth"] and truth["mismatches"] == []
    assert truth["mode"] == mode and truth["autocast"] == autocast
    [linear] = rows_of(truth, "Linear")  # one combination for all six
    assert linear["count"] == 6 and linear["example"] == "net.blocks.0.0.weight"
    assert (linear["weights"], linear["grads"], linear["autocast"]) == ("fp32", "fp32", autocast)
    assert linear["optimizer_state"] == {"exp_avg": "fp32", "exp_avg_sq": "fp32"}  # no `step`
    assert linear["master"] is linear["gather"] is linear["reduce"] is None  # one process


def test_fp16_master_holds_fp16_weights_fp32_masters_and_keeps_islands_fp32(tmp_path):
    run(make_cfg(*net_run("precision=fp16_master", "precision.fp32_modules=[net.head]")), tmp_path)
    truth = truth_of(tmp_path)
    assert truth["mismatches"] == [] and truth["autocast"] == "fp16"
    blocks = rows_of(truth, "Linear", "net.blocks.")
    assert held(blocks, "weights") == held(blocks, "grads") == {"fp16"}
    assert held(blocks, "master") == held(blocks, "master_grads") == {"fp32"}
    norms = rows_of(truth, "LayerNorm")
    assert held(norms, "weights") == {"fp32"} and held(norms, "master") == {None}
    head = rows_of(truth, "Linear", "net.head.")
    assert held(head, "autocast") == {"off (island)"}
    assert held(head, "weights") == {"fp32"} and held(head, "master") == {None}
    states = {s for r in truth["rows"] for s in r["optimizer_state"].values()}
    assert states == {"fp32"}  # the optimizer steps the fp32 masters


def test_a_net_that_casts_itself_to_bf16_is_named_in_a_warning(tmp_path, capsys):
    run(make_cfg(*net_run("precision=bf16", net="HalfHeadNet")), tmp_path)
    truth = truth_of(tmp_path)
    head = rows_of(truth, "Linear", "net.head.")
    assert held(head, "weights") == held(head, "grads") == {"bf16"}
    weights, *state = truth["mismatches"]
    assert weights == (
        "weights are bf16, but precision=bf16 keeps fp32 weights and autocasts per op "
        "(a .half() or .to(dtype) in the model?): 2 parameter(s) of Linear (e.g. net.head.weight)"
    )
    assert [s.split(":")[0] for s in state] == [
        "optimizer state exp_avg is bf16, not fp32",
        "optimizer state exp_avg_sq is bf16, not fp32",
    ]
    out = capsys.readouterr()
    assert "warning: precision truth: weights are bf16" in out.err
    assert "precision truth  3 mismatches" in out.out  # the final summary


@pytest.mark.parametrize(
    "overrides",
    [
        ["precision=bf16", "optim.state_dtype=bf16"],
        ["precision=bf16_true", "optim.state_dtype=fp32"],
        ["precision=bf16_true", "optim.state_dtype=fp32", "precision.update=kahan"],
    ],
)
def test_the_state_dtype_asked_for_is_no_mismatch(tmp_path, overrides):
    """The moments are in optim.state_dtype, as the checkpoint holds them; kahan's compensation
    buffer in the bf16 weights' dtype."""
    run(make_cfg(*net_run(*overrides)), tmp_path)
    truth = truth_of(tmp_path)
    assert truth["mismatches"] == []
    asked = overrides[1].split("=")[1]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[asked]
    for state in load_last(tmp_path)["optimizer"]["state"].values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == dtype
    for row in truth["rows"]:
        assert row["optimizer_state"]["exp_avg"] == row["optimizer_state"]["exp_avg_sq"] == asked
    if "precision.update=kahan" in overrides:
        linears = rows_of(truth, "Linear")
        assert {r["optimizer_state"]["compensation"] for r in linears} == {"bf16"}


def test_adamw8bit_state_shows_its_8bit_parts_and_is_no_mismatch(tmp_path, monkeypatch):
    """torchao's 8-bit state shows the dtype it dequantizes to (fp32); the table gives the parts
    it holds, as the checkpoint has them."""
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)  # eager: see test_bf16_true
    run(make_cfg(*net_run("optim=adamw8bit", "+model.net.width=64")), tmp_path)
    truth = truth_of(tmp_path)
    assert truth["mismatches"] == []
    [quantized] = [r for r in truth["rows"] if r["example"] == "net.blocks.1.0.weight"]
    state = load_last(tmp_path)["optimizer"]["state"]
    [parts] = [s["exp_avg"]["tensors"] for s in state.values() if isinstance(s["exp_avg"], dict)]
    assert parts["codes"].dtype == torch.uint8
    names = {torch.uint8: "uint8", torch.float32: "fp32"}
    shown = ", ".join(f"{names[t.dtype]} {name}" for name, t in parts.items())
    assert quantized["optimizer_state"] == {"exp_avg": shown, "exp_avg_sq": shown}
    small = [r for r in truth["rows"] if r is not quantized]  # under 4096 elements: plain fp32
    assert {s for r in small for s in r["optimizer_state"].values()} == {"fp32"}


def test_state_in_another_dtype_than_asked_is_a_mismatch():
    """torch's AdamW keeps the moments in the weights' fp32: with optim.state_dtype=bf16 asked,
    that is named."""
    net = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(net.parameters())
    net(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    precision = Precision(PrecisionConfig(mode="bf16"), torch.device("cpu"))
    truth = precision_truth(net, net, precision, [optimizer], "bf16")
    assert [m.split(":")[0] for m in truth["mismatches"]] == [
        "optimizer state exp_avg is fp32, not bf16",
        "optimizer state exp_avg_sq is fp32, not bf16",
    ]


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
def test_fsdp_gathers_blocks_in_bf16_and_ddp_reduces_as_asked(tmp_path):
    """FSDP bf16: fp32 shards; the blocks' Linears gathered in bf16, their LayerNorms and the
    root's head in fp32, as each unit's MixedPrecisionPolicy says. DDP with reduce_dtype=bf16:
    its comm hook averages in bf16."""
    fsdp, ddp = tmp_path / "fsdp", tmp_path / "ddp"
    run_ranks(
        [
            (net_run("precision=bf16", "trainer.strategy=fsdp"), fsdp),
            (net_run("precision=bf16", "precision.reduce_dtype=bf16"), ddp),
        ]
    )
    truth = truth_of(fsdp)
    assert truth["mismatches"] == truth_of(ddp)["mismatches"] == []
    for row in truth["rows"]:
        assert (row["weights"], row["grads"], row["reduce"]) == ("fp32", "fp32", "fp32")
        assert set(row["optimizer_state"].values()) == {"fp32"}
    assert held(rows_of(truth, "Linear", "net.blocks."), "gather") == {"bf16"}
    assert held(rows_of(truth, "Linear", "net.head."), "gather") == {"fp32"}
    assert held(rows_of(truth, "LayerNorm"), "gather") == {"fp32"}
    assert held(truth_of(ddp)["rows"], "reduce") == {"bf16"}
