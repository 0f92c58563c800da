"""precision=nvfp4 and mxfp4 (runner/precision/fp4.py, emulated on a CPU): the quantizers against
hand-computed values (and torchao's, bit for bit), the recipe's parts (stochastic rounding, the
random Hadamard transform, 2-D weight tiles), a non-finite block reaching the run's guard, a tiny
GPT training next to bf16, and which matmuls are FP4 read from the precision manifest."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from runner.errors import TrainingStopped, UserError
from runner.precision import fp4_quant
from runner.precision.fp4 import Fp4Linears, Recipe, _Fp4Linear
from runner.precision.fp4_mm import FP4_MM
from runner.precision.fp4_quant import MXFP4, NVFP4, quantize
from runner.run import run
from tests.helpers import make_cfg, read_metrics
from tests.test_manifest import ops

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _gpt(*overrides: str, width: int = 16, steps: int = 2, layers: int = 2) -> list[str]:
    return [
        "model=module",
        "model.net._target_=tests.test_own_model.TinyGPT",
        f"+model.net.width={width}",
        f"+model.net.layers={layers}",  # its blocks: Task.shard_units, however many
        "dataset.train._target_=tests.test_own_model.token_pairs",
        "dataset.batch_size=16",
        "model.loss=output",
        f"trainer.max_steps={steps}",
        "trainer.val_check_interval=0",
        "trainer.progress_bar=false",
        "logger=none",
        *overrides,
    ]


# --- the quantizers ------------------------------------------------------------------------


def test_the_e2m1_grid_and_its_ties_to_even():
    """MXFP4 with a block whose largest value is 6 has scale 2^0: the values come back as the
    grid holds them, midpoints go to the even code, 7 saturates at 6, signs are kept."""
    block = torch.tensor([6.0, *GRID[1:], -0.5, -6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0])
    block = torch.cat((block, torch.zeros(32 - block.numel()))).reshape(1, 32)
    q = quantize(block, MXFP4)
    assert q.scales.float().item() == 1.0
    got = q.dequantize()[0, :18].tolist()
    assert got == [6.0, *GRID[1:], -0.5, -6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    assert q.saturated.item()  # 7 clipped at 6: MX's floor exponent
    # NVFP4 keeps grid values too (its scales multiply out to 1 within an ulp)
    x = torch.tensor([GRID * 2])
    torch.testing.assert_close(quantize(x, NVFP4).dequantize(), x, rtol=1e-6, atol=0)


def test_nvfp4_block_scales_round_to_e4m3_under_the_tensor_scale():
    """The per-tensor scale maps the tensor's amax to 6 × 448; each block's scale (its amax / 6
    over that) rounds to E4M3: 20/6 = 3.33 → 3.25, and a block far below the amax clamps to
    E4M3's smallest normal, 2^-6, so its values all round to zero (underflow)."""
    x = torch.zeros(1, 48)
    x[0, 0] = 2688.0  # tensor scale 2688 / (6 × 448) = 1
    x[0, 16] = 20.0
    x[0, 32:48] = 1e-3
    q = quantize(x, NVFP4)
    assert q.tensor_scale.item() == 1.0
    assert q.scales.float().tolist() == [[448.0, 3.25, 2.0**-6]]
    assert q.dequantize()[0, 16].item() == 6 * 3.25  # 20 / 3.25 = 6.15 → 6
    assert q.underflow.tolist() == [[False, False, True]]
    y = torch.full((2, 16), 3.0)
    assert quantize(y, NVFP4).tensor_scale.item() == pytest.approx(3.0 / 2688)


def test_mxfp4_scales_are_e8m0_powers_of_two():
    """2^(floor(log2 amax) − 2): amax 5 → 2^0, 0.3 → 2^-4, 120 → 2^4; stored as E8M0."""
    x = torch.zeros(3, 32)
    x[0, 0], x[1, 0], x[2, 0] = 5.0, 0.3, 120.0
    q = quantize(x, MXFP4)
    assert q.scales.dtype == torch.float8_e8m0fnu
    assert q.scales.float().flatten().tolist() == [1.0, 2.0**-4, 16.0]
    # 5 → 4 (a tie, to even); 0.3 × 16 = 4.8 → 4; 120 / 16 = 7.5 → 6 (saturated)
    assert q.dequantize()[:, 0].tolist() == [4.0, 0.25, 96.0]
    assert q.saturated.flatten().tolist() == [False, False, True]


def test_quantizers_match_torchao_bit_for_bit():
    """On a tensor spanning six decades, zeros included: torchao's NVFP4 (two-level) and MXFP4
    (floor) quantizers give the same scales and packed data."""
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    torch.manual_seed(0)
    x = torch.randn(32, 64) * torch.logspace(-4, 2, 32)[:, None]
    x[0, :32] = 0
    scales, data = nvfp4_quantize(x, 16, per_tensor_amax_to_scale(x.abs().amax()))
    q = quantize(x, NVFP4)
    assert torch.equal(scales.view(torch.uint8).flatten(), q.scales.view(torch.uint8).flatten())
    assert torch.equal(data.view(torch.uint8).flatten(), q.packed().view(torch.uint8).flatten())
    scales, data = to_mx(x, torch.float4_e2m1fn_x2, 32)
    q = quantize(x, MXFP4)
    assert torch.equal(scales.view(torch.uint8).flatten(), q.scales.view(torch.uint8).flatten())
    assert torch.equal(data.view(torch.uint8).flatten(), q.packed().view(torch.uint8).flatten())


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.name)
def test_a_block_of_zeros_and_a_block_with_inf_or_nan(fmt):
    """Zeros stay zeros (no NaN from a zero scale, not counted as underflow); a block holding an
    inf or a NaN dequantizes to NaN (its scale is NaN), never to a finite ±6."""
    x = torch.randn(4, 2 * fmt.block)
    x[0, : fmt.block] = 0
    q = quantize(x, fmt)
    assert torch.equal(q.dequantize()[0, : fmt.block], torch.zeros(fmt.block))
    assert not q.underflow.any() and q.dequantize().isfinite().all()
    assert torch.equal(
        quantize(torch.zeros(2, fmt.block), fmt).dequantize(), torch.zeros(2, fmt.block)
    )
    for bad in (float("inf"), float("nan")):
        y = x.clone()
        y[1, 3] = bad
        got = quantize(y, fmt).dequantize()
        assert got[1, : fmt.block].isnan().all()
        if fmt is MXFP4:  # one scale per block only: the others are untouched
            assert got[2:].isfinite().all()


def test_stochastic_rounding_is_unbiased_and_round_to_nearest_is_not():
    """2.4 lies between the grid's 2 and 3: round to nearest always gives 2 (a bias of −0.4);
    stochastic rounding gives 3 four times in ten, a mean of 2.4 within sampling error."""
    x = torch.full((4000, 32), 2.4)
    x[:, 0] = 6.0  # scale 2^0
    rtn = quantize(x, MXFP4).dequantize()[:, 1:]
    sr = quantize(x, MXFP4, stochastic=True, generator=torch.Generator().manual_seed(0))
    values = sr.dequantize()[:, 1:]
    assert rtn.unique().tolist() == [2.0]
    assert set(values.unique().tolist()) == {2.0, 3.0}
    se = (0.4 * 0.6 / values.numel()) ** 0.5
    assert abs(values.mean().item() - 2.4) < 4 * se


# --- the recipe ----------------------------------------------------------------------------


def _wgrad(recipe: Recipe, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    w = w.clone().requires_grad_()
    _Fp4Linear.apply(x, w, recipe, "Linear").backward(dy)
    return w.grad


def test_the_hadamard_transform_is_orthogonal_so_wgrad_is_exact_without_quantization():
    """Hᵀ H = I (a random sign vector, Sylvester's 16×16, over 4): with quantization off the
    weight gradient (H dy)ᵀ (H x) is dyᵀ x to rounding; quantized, the transform changes it."""
    torch.manual_seed(0)
    x, w, dy = torch.randn(64, 32), torch.randn(48, 32), torch.randn(64, 48)
    exact = Recipe(NVFP4, rht=True, sr=False, quantize=False, seed=1)
    h = exact.transform()
    torch.testing.assert_close(h.t() @ h, torch.eye(16), atol=1e-6, rtol=0)
    assert set(h.abs().flatten().tolist()) == {0.25} and (h[0] < 0).any()  # random signs
    torch.testing.assert_close(exact.rotate(x), torch.block_diag(*[h] * 4) @ x)
    torch.testing.assert_close(_wgrad(exact, x, w, dy), dy.t() @ x, rtol=1e-5, atol=1e-4)
    on = _wgrad(Recipe(NVFP4, rht=True, sr=False, seed=1), x, w, dy)
    off = _wgrad(Recipe(NVFP4, rht=False, sr=False, seed=1), x, w, dy)
    assert not torch.equal(on, off)


class _Gemms(TorchDispatchMode):
    """Each fp4_mm's roles and its two operands, dequantized."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket is FP4_MM:
            a, b = fp4_quant.dequantize(*args[:3]), fp4_quant.dequantize(*args[3:6])
            self.seen[args[6]] = (a, b)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("two_d", [True, False])
def test_with_weight_2d_forward_and_backward_multiply_one_quantized_weight(two_d):
    """The forward's W operand (out × in, blocks along in) and the input gradient's (in × out,
    blocks along out) are one tensor transposed with 16×16 tiles; 1×16 blocks along each GEMM's
    inner dimension quantize W two ways."""
    torch.manual_seed(0)
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    gemms = _Gemms()
    with gemms:
        _Fp4Linear.apply(x, w, Recipe(NVFP4, weight_2d=two_d, seed=0), "Linear").sum().backward()
    assert set(gemms.seen) == {"x,w", "dy,w", "dy,x"}
    forward_w, backward_w = gemms.seen["x,w"][1], gemms.seen["dy,w"][1].t()
    assert torch.equal(forward_w, backward_w) is two_d


# --- in a run ------------------------------------------------------------------------------


class InfGPT(nn.Module):
    """TinyGPT with one weight of a converted Linear inf."""

    def __new__(cls, **kwargs):
        from tests.test_own_model import TinyGPT

        net = TinyGPT(**kwargs)
        with torch.no_grad():
            net.blocks[0].mlp[0].weight[5, 3] = float("inf")
        return net


def test_an_inf_in_an_fp4_block_reaches_the_non_finite_guard(tmp_path):
    """MXFP4: the block's scale goes NaN, the forward NaN, and the run stops as any
    non-finite run does (clamped to ±6 instead, it would train on quietly)."""
    cfg = make_cfg(
        *_gpt(
            "precision=mxfp4",
            "model.net._target_=tests.test_fp4.InfGPT",
            "trainer.max_consecutive_nonfinite=2",
            width=32,
            steps=4,
        )
    )
    with pytest.raises(TrainingStopped, match="non-finite"):
        run(cfg, tmp_path)
    assert all(r["skipped"] for r in read_metrics(tmp_path))


def test_a_tiny_gpt_trains_in_nvfp4_within_a_few_percent_of_bf16(tmp_path):
    """Every Linear but the head in NVFP4 (the recipe on), 10 steps: the loss falls and ends
    within 3% of bf16's, yet not equal to it (the GEMMs did run in FP4)."""
    common = ["precision.fp4.keep_bf16.last=0", "precision.fp4.skip=[last]"]
    losses = {}
    for mode in ("bf16", "nvfp4"):
        extra = common if mode == "nvfp4" else []
        cfg = make_cfg(*_gpt(f"precision={mode}", "optim.optimizer.lr=1e-2", *extra, steps=10))
        summary = run(cfg, tmp_path / mode)
        rows = read_metrics(tmp_path / mode)
        assert rows[-1]["loss"] < 0.95 * rows[0]["loss"]
        losses[mode] = summary["final_loss"]
    assert summary["plan_held"] is True
    assert len(summary["converted"]["converted"]) == 8  # all of two blocks'
    assert losses["nvfp4"] != losses["bf16"]
    assert losses["nvfp4"] == pytest.approx(losses["bf16"], rel=0.03)


def test_the_manifest_sees_fp4_gemms_and_keep_bf16_and_islands_move_them(tmp_path, monkeypatch):
    """Default nvfp4 on a 4-block GPT: block 3 (keep_bf16.last=1), the first Linear and the head
    in bf16, the rest computing forward, input gradient and weight gradient in nvfp4 on E2M1
    operands (the weight in 16×16 tiles); keep_bf16.last=0 moves block 1 into nvfp4, an fp32
    island on block 0's MLP moves it to fp32. A switch that runs the plain Linear fails the plan."""
    gpt = functools.partial(_gpt, layers=4, steps=1)  # the audited step is the first

    def fp4_modules(summary):
        return {o["module"] for o in ops(summary) if o["format"] == "nvfp4"}

    default = run(make_cfg(*gpt("precision=nvfp4")), tmp_path / "default")
    assert default["plan_held"] is True
    linears = ("qkv", "proj", "mlp.0", "mlp.2")
    block = {i: {f"net.blocks.{i}.{n}" for n in linears} for i in range(4)}
    converted = block[0] - {"net.blocks.0.qkv"} | block[1] | block[2]
    assert fp4_modules(default) == converted
    for o in ops(default, prefix="net.blocks.0.mlp.0"):
        assert o["format"] == "nvfp4" and o["op"] == "fp4_mm"
        assert (
            o["inputs"]
            == {
                "forward": ["nvfp4 e2m1 block 16", "nvfp4 e2m1 tile 16×16"],
                "input_grad": ["nvfp4 e2m1 block 16", "nvfp4 e2m1 tile 16×16"],
                "weight_grad": ["nvfp4 e2m1 block 16", "nvfp4 e2m1 block 16"],
            }[o["direction"]]
        )
    # bf16 (computed in fp32 where precision.cpu_kernels=fast does)
    assert {o["format"] for o in ops(default, prefix="net.blocks.3.")} <= {"fp32", "bf16"}
    assert default["converted"]["converted_flop_share"] > 0
    health = default["converted"]["fp4_health"]["by_class"]["Linear"]
    assert set(health) == {"input", "weight", "grad_output"}

    kept0 = run(
        make_cfg(*gpt("precision=nvfp4", "precision.fp4.keep_bf16.last=0")), tmp_path / "all"
    )
    assert fp4_modules(kept0) == converted | block[3]
    island = run(
        make_cfg(*gpt("precision=nvfp4", "precision.fp32_modules=[net.blocks.0.mlp]")),
        tmp_path / "island",
    )
    assert fp4_modules(island) == converted - {"net.blocks.0.mlp.0", "net.blocks.0.mlp.2"}
    assert {o["format"] for o in ops(island, prefix="net.blocks.0.mlp.")} == {"fp32"}
    assert island["plan_held"] is True
    assert "inside an fp32 island" in island["converted"]["skipped"]["net.blocks.0.mlp.0"]
    assert (
        read_metrics(tmp_path / "island")[-1]["loss"]
        != read_metrics(tmp_path / "default")[-1]["loss"]
    )

    monkeypatch.setattr(
        Fp4Linears, "_switch", lambda self, module, fwd, x: nn.Linear.forward(module, x)
    )
    broken = run(make_cfg(*gpt("precision=nvfp4")), tmp_path / "broken")
    assert broken["plan_held"] is False
    assert any(
        m.startswith("the plan converts net.blocks.0.proj to nvfp4;")
        for m in broken["precision_manifest"]["mismatches"]
    )


def test_gpt2_conv1d_converts_keeping_its_layout_and_fp8_keys_are_refused(tmp_path):
    """transformers' GPT-2 in mxfp4 (blocks of 32: n_embd 32): its Conv1Ds become Fp4Linears
    computing in mxfp4, saved in Conv1D's (in, out) layout; precision.fp8's keys are fp8's."""
    from tests.test_hf import causal_lm_on_text, hf, tiny_gpt2_and_text

    folder, text = tiny_gpt2_and_text(tmp_path, documents=40, layers=2)
    base = [
        *causal_lm_on_text(text),
        "dataset.seq_len=32",
        "dataset.batch_size=4",
        "trainer.max_steps=2",
        "trainer.val_check_interval=0",
        "precision=mxfp4",
    ]
    summary = run(hf(folder, *base), tmp_path / "gpt2")
    assert summary["plan_held"] is True
    attn = ops(summary, prefix="net.transformer.h.0.attn.c_proj")
    assert {o["format"] for o in attn} == {"mxfp4"} and attn[0]["class"] == "Fp4Linear"
    health = summary["converted"]["fp4_health"]["by_class"]
    assert "Conv1D" in health
    state = torch.load(tmp_path / "gpt2" / "checkpoints" / "last.pt", weights_only=True)["model"]
    c_attn = next(v for k, v in state.items() if k.endswith("h.0.attn.c_attn.weight"))
    assert tuple(c_attn.shape) == (32, 96)  # Conv1D's (in, out)
    with pytest.raises(UserError, match="precision.fp8.recipe"):
        run(hf(folder, *base, "precision.fp8.recipe=rowwise"), tmp_path / "refused")
