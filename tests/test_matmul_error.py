"""Each matmul's measured error (issue 40, item 1; runner/measure/matmul_error.py): the SQNR of
what the run computed against fp32 from the same operands, the operands' flushed and clamped
shares in the run's format and their amax, per module and direction; in summary.json, printed,
and in the comparison."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from torch import nn

from runner.measure.error_table import worst
from runner.measure.matmul_error import ErrorProbe
from runner.precision.cpu_kernels import FastKernels
from runner.run import run
from tests.helpers import TINY_MLP, make_cfg
from tests.test_fp4 import _gpt

MEASURED = "precision.matmul_error=true"  # the default, said
BF16_BITS = 8  # significant bits, the implicit one included


def rounding_noise(bits: int, sigma: float = 1.0) -> float:
    """E[(round(x) − x)²] / E[x²] for x ~ N(0, σ²) rounded to nearest with `bits` significant
    bits, from first principles: in the binade [2^e, 2^(e+1)) the spacing is 2^(e − bits + 1)
    and the error uniform over it (variance spacing²/12), weighted by the binade's probability."""
    total = 0.0
    for e in range(-60, 60):
        low, high = 2.0**e / sigma, 2.0 ** (e + 1) / sigma
        p = math.erf(high / math.sqrt(2)) - math.erf(low / math.sqrt(2))
        total += p * (2.0 ** (e - bits + 1)) ** 2 / 12
    return total / sigma**2


@pytest.mark.parametrize("kernels", ["native", "fast"])
def test_bf16_of_standard_normal_operands_is_bf16s_theoretical_sqnr(kernels):
    """x and W standard normal, K = 256: x·Wᵀ in bf16 carries the rounding of x, of W and of the
    product (bf16 output), each independent: noise/signal = ρ(x) + ρ(W) + ρ(y), ρ the relative
    rounding noise of a normal value (y ~ N(0, K)). The fast CPU kernels (bf16 inputs, fp32
    arithmetic, the output rounded) lose the same."""
    torch.manual_seed(0)
    k = 256
    layer = nn.Linear(k, 256, bias=False)
    nn.init.normal_(layer.weight)
    x = torch.randn(512, k)
    theory = -10 * math.log10(2 * rounding_noise(BF16_BITS) + rounding_noise(BF16_BITS, k**0.5))
    dtypes = frozenset({torch.bfloat16}) if kernels == "fast" else frozenset()
    with FastKernels(dtypes) as fast, ErrorProbe(layer, 1, converted=False) as probe:
        with torch.autocast("cpu", torch.bfloat16):
            layer(x).float().sum().backward()
    assert fast.calls == (2 if kernels == "fast" else 0)  # forward and weight gradient
    (forward,) = [r for r in probe.records() if r["direction"] == "forward"]
    assert theory == pytest.approx(50.8, abs=0.1)
    assert forward["sqnr_db"] == pytest.approx(theory, abs=1.0)
    assert forward["format"] == "bf16" and forward["calls"] == 1
    x_op, w_op = forward["operands"]["x"], forward["operands"]["w"]
    assert x_op["amax"] == x.abs().max().item() and w_op["amax"] == layer.weight.abs().max().item()
    assert x_op["underflow"] == x_op["clamp"] == w_op["underflow"] == 0
    assert {r["direction"] for r in probe.records()} == {"forward", "weight_grad"}  # x: no grad


class Spike(nn.Module):
    """Puts one 1e4 outlier in its input's first token (when on)."""

    def __init__(self, on: bool):
        super().__init__()
        self.on = on

    def forward(self, x):
        if not self.on:
            return x
        x = x.clone()
        x[0, 0] = 1e4
        return x


def _fp8_errors(outlier: bool) -> list[dict]:
    """Three tensorwise fp8 Linears (torchao's, without biases: the forward figure is x·Wᵀ's own)
    under bf16 autocast, activations of scale 0.1;
    the middle one's input has the outlier in a token outside the loss (its gradient zero, as a
    padded token's), so the outlier's own product adds nothing to the weight's gradient."""
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    linear = functools.partial(nn.Linear, 64, 64, bias=False)
    net = nn.Sequential(linear(), nn.ReLU(), Spike(outlier), linear())
    net.append(linear())
    convert_to_float8_training(net)
    x = torch.randn(64, 64) * 0.1
    dy = torch.randn(64, 64)
    dy[0] = 0
    with ErrorProbe(net, 1, converted=True) as probe:
        with torch.autocast("cpu", torch.bfloat16):
            y = net(x)
        y.backward(dy.to(y.dtype))
    return probe.records()


def test_a_tensorwise_fp8_outlier_flushes_its_operand_and_ranks_its_layer_worst():
    plain, spiked = _fp8_errors(False), _fp8_errors(True)

    def at(records, module, direction):
        return next(r for r in records if (r["module"], r["direction"]) == (module, direction))

    before, after = at(plain, "3", "weight_grad"), at(spiked, "3", "weight_grad")
    assert after["operands"]["x"]["format"] == "fp8 e4m3 tensorwise"
    assert after["operands"]["dy"]["format"] == "fp8 e5m2 tensorwise"
    assert before["operands"]["x"]["underflow"] < 0.01 < 0.1 < after["operands"]["x"]["underflow"]
    assert after["operands"]["x"]["amax"] > 9000 > 10 > before["operands"]["x"]["amax"]
    assert after["sqnr_db"] < before["sqnr_db"] - 5
    assert worst(spiked)[0]["module"] == "3" and worst(spiked)[0]["direction"] == "weight_grad"
    assert worst(plain)[0]["sqnr_db"] > after["sqnr_db"] + 5  # every layer was better before
    # the forward: the outlier's own product, held exactly, outweighs what the rest lost
    assert at(spiked, "3", "forward")["sqnr_db"] > at(plain, "3", "forward")["sqnr_db"]


LINEAR_DIRECTIONS = {"forward", "input_grad", "weight_grad"}


def _manifest_pairs(summary: dict) -> set[tuple[str, str]]:
    """The manifest's (module, direction) of every weight-carrying matmul module."""
    pairs = set()
    for name, entry in summary["precision_manifest"]["stages"][0]["modules"].items():
        if "Linear" in entry["class"] or entry["class"] == "Conv1D":
            pairs |= {(name, o["direction"]) for o in entry["ops"]}
    return pairs & {(n, d) for n, _ in pairs for d in LINEAR_DIRECTIONS}


@pytest.mark.parametrize("mode", ["fp32", "fp16", "bf16", "fp8", "mxfp8", "nvfp4", "mxfp4"])
def test_a_run_writes_every_matmuls_error_into_its_summary(mode, tmp_path, capsys):
    """A 2-block GPT of width 32 (mxfp8 and mxfp4 blocks), 2 steps: one record per module and
    direction the manifest saw, a finite SQNR (fp32: none lost), the converted Linears in the
    mode's format; the 3 worst printed; summary.json holds the table."""
    summary = run(make_cfg(MEASURED, *_gpt(f"precision={mode}", width=32)), tmp_path)
    records = summary["matmul_error"]
    pairs = {(r["module"], r["direction"]) for r in records}
    modules = {m for m, _ in _manifest_pairs(summary)}
    assert pairs >= _manifest_pairs(summary)  # every matmul the manifest saw, in its direction
    assert pairs == {(m, d) for m in modules for d in LINEAR_DIRECTIONS}  # every input has a grad
    assert all(r["step"] == 1 and r["calls"] == 1 for r in records)
    sqnr = [r["sqnr_db"] for r in records]
    if mode == "fp32":
        assert all(s == math.inf for s in sqnr)
    else:
        assert all(math.isfinite(s) and 0 < s < 80 for s in sqnr), sqnr
    # each record computed in what the manifest saw (the forced avx2 kind's fast kernels: fp32
    # from bf16 or fp16 operands), the converted Linears in the mode's format
    seen = {
        (name, o["direction"]): o["format"]
        for name, entry in summary["precision_manifest"]["stages"][0]["modules"].items()
        for o in entry["ops"]
    }
    assert all(r["format"] == seen[r["module"], r["direction"]] for r in records), records
    operands = {o["format"] for r in records for o in r["operands"].values()}
    if mode in ("fp32", "fp16", "bf16"):
        assert operands == {mode}
    else:
        assert mode in {r["format"] for r in records}
    for r in records:
        for o in r["operands"].values():
            assert 0 <= o["underflow"] <= 1 and 0 <= o["clamp"] <= 1 and o["amax"] > 0
    saved = json.loads((tmp_path / "summary.json").read_text())["matmul_error"]
    assert len(saved) == len(records)
    printed = capsys.readouterr()
    out = " ".join((printed.out + printed.err).split())
    assert (
        f"matmul error, step 1: the 3 worst of {len({r['module'] for r in records})} modules" in out
    )


def test_every_n_steps_measures_those_steps_too(tmp_path):
    summary = run(
        make_cfg(
            MEASURED,
            *TINY_MLP,
            "trainer.max_steps=5",
            "precision=bf16",
            "precision.error_every_n_steps=2",
        ),
        tmp_path,
    )
    assert sorted({r["step"] for r in summary["matmul_error"]}) == [1, 2, 4]


def test_the_comparison_names_each_rows_worst_layer(tmp_path):
    """The comparison's "worst layer": the module, direction and SQNR of the lowest SQNR its
    jobs measured; fp32's "no error"; a job from before the table "—"."""
    from runner.compare import compare
    from tests.test_compare import fake_job

    def table(*rows):
        return [{"module": m, "direction": d, "sqnr_db": s, "operands": {}} for m, d, s in rows]

    inf = "inf"  # as summary.json holds it (tracking.jsonable)
    fake_job(tmp_path / "0", "fp32", summary={"matmul_error": table(("net.0", "forward", inf))})
    fp8 = table(
        ("net.0", "forward", 31.0), ("net.3", "weight_grad", 16.6), ("net.4", "input_grad", 24.8)
    )
    fake_job(tmp_path / "1", "fp8", speed=150.0, summary={"matmul_error": fp8})
    fake_job(tmp_path / "2", "bf16", speed=120.0)
    groups = compare(tmp_path, wandb_log=False)
    assert [g.figures["worst_layer"] for g in groups] == ["no error", "net.3 wgrad 16.6 dB", None]
    md = (tmp_path / "compare.md").read_text().splitlines()
    column = md[2].split(" | ").index("worst layer")
    assert [line.split(" | ")[column] for line in md[4:7]] == [
        "no error",
        "net.3 wgrad 16.6 dB",
        "—",
    ]


def test_a_negative_error_every_n_steps_is_one_error(tmp_path):
    from runner.errors import UserError

    with pytest.raises(UserError, match="precision.error_every_n_steps=-1 is invalid"):
        run(make_cfg(MEASURED, *TINY_MLP, "precision.error_every_n_steps=-1"), tmp_path)


def _peak(tmp_path, on: bool) -> float:
    from tests.test_max_batch import SHORT, profiled

    overrides = [*TINY_MLP, *SHORT, "dataset.batch_size=3500", f"precision.matmul_error={on}"]
    return profiled(lambda: run(make_cfg(*overrides), tmp_path / str(on)))[1]


def test_the_probe_adds_next_to_nothing_to_the_steps_peak_memory(tmp_path):
    """The max-batch search's tiny MLP at 3500 samples, torch.profiler's peak over the run: a
    block of rows at a time (runner/measure/error_sums.py), the probe's references and quantized
    copies stay under the step's own peak (4.58 MB against 4.46; whole, they took it to 8.7)."""
    assert _peak(tmp_path, True) <= 1.1 * _peak(tmp_path, False)


def test_the_probes_own_matmuls_are_not_the_steps_record_nor_its_projection():
    """An nvfp4 Linear between two bf16 ones, audited as a run's audited step is, with the probe
    and without: the same ops, matmuls and traffic, and so the same projection."""
    from runner.measure import gpus
    from runner.measure import projection as P
    from runner.precision.fp4 import Fp4Linear, Recipe
    from runner.precision.fp4_quant import FORMATS
    from tests.test_projection import _audit

    torch.manual_seed(0)
    fp4 = Fp4Linear(64, 64, bias=False)
    fp4.recipe = Recipe(FORMATS["nvfp4"], weight_2d=True, rht=True, sr=False, seed=0)
    net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), fp4, nn.GELU(), nn.Linear(64, 64))
    x = torch.randn(128, 64)

    def step():
        net.zero_grad(set_to_none=True)  # each step's gradients are new (AccumulateGrad's traffic)
        with torch.autocast("cpu", torch.bfloat16):
            y = net(x)
        y.float().square().sum().backward()

    step()  # once first: the layer makes its random Hadamard transform on its first backward
    plain = _audit(net, step, "nvfp4")
    with ErrorProbe(net, 1, converted=True) as probe:
        probed = _audit(net, step, "nvfp4")
    assert len(probe.records()) == 8  # 3 Linears × 3 directions, less the input x's gradient
    assert probed == plain
    b200 = gpus.spec("B200")
    assert P.project_stage(probed, b200) == P.project_stage(plain, b200)
