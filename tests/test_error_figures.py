"""Every figure of each matmul's measured error is right in every case (issue 46, item 4;
runner/measure/matmul_error.py, runner/measure/quant_shares.py), each checked against an
independent quantization: torchao's own casts, or exact rounding written here.

- a module called twice in one forward under autocast: each call's weight gradient measured;
- fp8 rowwise (and tensorwise, mxfp8) shares equal torchao's casts exactly, scales rounded to a
  power of two where the recipe does;
- dy's underflow where dy is cast into fp16 (fp16's gradient underflow visible);
- clamped: only what rounds past the format's largest finite value after scaling."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from runner.measure.matmul_error import ErrorProbe


def _at(records: list[dict], module: str, direction: str) -> dict:
    return next(r for r in records if (r["module"], r["direction"]) == (module, direction))


class Siamese(nn.Module):
    """One encoder applied to two inputs (`twice`), or to the first alone; the loss inside the
    model's forward, as a task's is."""

    def __init__(self, twice: bool):
        super().__init__()
        self.twice = twice
        self.enc = nn.Linear(64, 64)

    def forward(self, a, b):
        loss = self.enc(a).float().square().mean()
        if self.twice:
            loss = loss + self.enc(b).float().square().mean()
        return loss


def _siamese(twice: bool, mode: str) -> list[dict]:
    torch.manual_seed(0)
    net = Siamese(twice)
    converted = mode == "fp8"
    if converted:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(net)
    a, b = torch.randn(256, 64), torch.randn(256, 64)
    dtype = {"fp16": torch.float16, "fp32": None}.get(mode, torch.bfloat16)
    with ErrorProbe(net, 1, converted=converted) as probe:
        with torch.autocast("cpu", dtype or torch.bfloat16, enabled=dtype is not None):
            loss = net(a, b)
        loss.backward()
    return probe.records()


@pytest.mark.parametrize("mode", ["bf16", "fp16", "fp32", "fp8"])
def test_a_module_called_twice_measures_each_calls_weight_gradient(mode):
    """Autocast casts the weight once and caches the cast: the cast's backward node, made in the
    first call, receives both calls' gradients. Each call's own is measured (bf16: 54.8 dB
    twice, 54.9 dB once; it was 2.5 dB, calls=1)."""
    once, twice = _siamese(False, mode), _siamese(True, mode)
    for direction in ("forward", "weight_grad"):
        one, two = _at(once, "enc", direction), _at(twice, "enc", direction)
        assert (one["calls"], two["calls"]) == (1, 2)
        if mode == "fp32":
            assert one["sqnr_db"] == two["sqnr_db"] == float("inf")
        else:
            assert two["sqnr_db"] == pytest.approx(one["sqnr_db"], abs=1.0), (one, two)


def _log_normal(*shape: int, sigma: float = 3.0) -> torch.Tensor:
    """Magnitudes spanning many binades, random signs: a row's or block's smallest flush."""
    return (torch.randn(*shape) * sigma).exp() * torch.randn(*shape).sign()


# The magnitude past which a scaled value rounds beyond the format's largest finite, exact: the
# point halfway to the next binade value (e4m3: 448 → 480, e5m2: 57344 → 65536) is a tie, which
# rounds to the even significand (e4m3: 448, 1.110b; e5m2: 65536, 1.00b).
def _past_e4m3(v):
    return v > 464


def _past_e5m2(v):
    return v >= 61440


def _torchao_fp8(m: torch.Tensor, cast_config, pow2: bool) -> tuple[float, float]:
    """torchao's own dynamic cast of `m` (its inner dimension last, a row's scale along it):
    the shares of its nonzero elements that flush to zero and that saturate."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    rowwise = cast_config.scaling_granularity.name == "AXISWISE"
    fp8 = hp_tensor_to_float8_dynamic(
        m.contiguous(),
        cast_config.target_dtype,
        LinearMMConfig(),
        scaling_granularity=cast_config.scaling_granularity,
        axiswise_dim=-1 if rowwise else None,
        round_scales_to_power_of_2=pow2,
    )
    nonzero = m != 0
    flushed = (nonzero & (fp8._data.float() == 0)).sum().item()
    scaled = (m.float() * fp8._scale).abs()
    past = _past_e4m3 if cast_config.target_dtype == torch.float8_e4m3fn else _past_e5m2
    total = nonzero.sum().item()
    return flushed / total, past(scaled).sum().item() / total


@contextlib.contextmanager
def _cuda_autocast_state(dtype: torch.dtype):
    """CUDA autocast's state on, as Float8Linear.forward reads it (it then casts its input to
    that dtype): set here on a CPU, where no op is autocast by it."""
    was, old = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", was)
        torch.set_autocast_dtype("cuda", old)


@pytest.mark.parametrize("cuda_autocast", [False, True])
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp", "tensorwise"])
def test_fp8_shares_equal_torchaos_own_casts(recipe, cuda_autocast):
    """A Float8Linear of torchao's recipe, 4096 tokens × 64 of log-normal x, dy and weight: every
    operand's flushed and clamped shares equal torchao's own cast of it (its scale rounded down
    to a power of two in the rowwise recipes, as torchao's are), exactly. Rowwise x was 3.48%
    flushed and 0.27% clamped before, where torchao flushes 4.38% and clamps none. Under CUDA
    autocast (bf16) the layer casts its input to bf16 first, and scales that."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64, bias=False))
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(net, config=config)
    with torch.no_grad():
        net[0].weight.copy_(_log_normal(64, 64, sigma=2.0))
    x, dy = _log_normal(4096, 64).requires_grad_(), _log_normal(4096, 64)
    state = _cuda_autocast_state(torch.bfloat16) if cuda_autocast else contextlib.nullcontext()
    with ErrorProbe(net, 1, converted=True) as probe:
        with state:
            y = net(x)
        dy = dy.to(y.dtype)
        y.backward(dy)
    w = net[0].weight.detach()
    scaled_x = x.detach().to(y.dtype)  # what the layer scales
    operands = {
        "forward": ((scaled_x, config.cast_config_input), (w, config.cast_config_weight)),
        "input_grad": (
            (dy, config.cast_config_grad_output),
            (w.t(), config.cast_config_weight_for_grad_input),
        ),
        "weight_grad": (
            (dy.t(), config.cast_config_grad_output_for_grad_weight),
            (scaled_x.t(), config.cast_config_input_for_grad_weight),
        ),
    }
    flushed_somewhere = False
    for direction, pairs in operands.items():
        record = _at(probe.records(), "0", direction)
        for (m, cast_config), (role, o) in zip(pairs, record["operands"].items(), strict=True):
            if cast_config.scaling_type.name == "DISABLED":
                assert o["format"] == "fp32" and o["underflow"] == o["clamp"] == 0
                continue
            truth = _torchao_fp8(m, cast_config, config.round_scales_to_power_of_2)
            assert (o["underflow"], o["clamp"]) == truth, (direction, role, o, truth)
            flushed_somewhere |= truth[0] > 0.01
    assert flushed_somewhere


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_fp4_clamps_only_what_rounds_past_6(name):
    """An FP4 Linear's x (blocks of 16 or 32, standard normal) and weight (16×16 or 32×32 tiles):
    a value scaled past 6 that rounds to 6 anyway is not clamped. The test's own rounding of
    the project's quantizer's scaled magnitudes, with no largest value: between 4 and 8 the
    spacing is 2, ties to even (7 → 8), and what lands past 6 is clamped. nvfp4's E4M3 block
    scale, rounded down, takes a block's largest to at most 6.375: none clamps (3.4% of x was
    reported clamped); mxfp4's power-of-two scale takes it anywhere in [4, 8): those in [7, 8)
    clamp (mxfp4's x: 0.86%, where 2.33% was reported)."""
    from runner.precision.fp4 import Fp4Linear, Recipe
    from runner.precision.fp4_quant import FORMATS, quantize

    torch.manual_seed(0)
    fmt = FORMATS[name]
    layer = Fp4Linear(64, 64, bias=False)
    layer.recipe = Recipe(fmt, weight_2d=True, rht=False, sr=False, seed=0)
    x = torch.randn(1024, 64)
    with ErrorProbe(layer, 1, converted=True) as probe:
        layer(x).square().sum().backward()
    record = _at(probe.records(), "", "forward")
    tiles = {"x": (1, fmt.block), "w": (fmt.block, fmt.block)}
    clamped = {}
    for role, m in (("x", x), ("w", layer.weight.detach())):
        q = quantize(m, fmt, tiles[role])
        scale = q.scales.float().repeat_interleave(tiles[role][0], 0)
        scale = scale.repeat_interleave(tiles[role][1], 1)
        magnitude = m.abs() * ((1.0 / q.tensor_scale) / scale)
        rounded = torch.where(magnitude >= 4, torch.round(magnitude / 2) * 2, magnitude)
        truth = (rounded > 6).sum().item() / m.numel()
        flushed = ((q.codes & 7) == 0).sum().item() / m.numel()
        o = record["operands"][role]
        assert (o["clamp"], o["underflow"]) == (truth, flushed), (role, o, truth, flushed)
        clamped[role] = truth
    assert (clamped["x"] == 0) if name == "nvfp4" else (clamped["x"] > 0.001)


def test_mxfp8_and_fp16_shares_equal_their_own_casts():
    """mxfp8 against torchao's to_mx (RCEIL, blocks of 32), fp16 and bf16 against torch's cast
    (clamped: what overflows to inf), on log-normal values wide enough for mxfp8 and fp16 to
    flush and fp16 to overflow."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    from runner.measure.quant_shares import MXFP8, cast, counts

    torch.manual_seed(0)
    m = _log_normal(512, 64, sigma=6.0)
    m[0, :32] = 1e-40  # a block whose amax E8M0 cannot scale up: torchao scales it by 1
    nonzero = (m != 0).sum().item()

    def shares(fmt) -> tuple[float, float]:
        found, flushed, clamped, _ = counts(m, fmt).tolist()
        assert found == nonzero
        return flushed / nonzero, clamped / nonzero

    _, data = to_mx(m, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    truth = ((m != 0) & (data.float() == 0)).sum().item() / nonzero
    assert shares(MXFP8) == (truth, 0.0) and truth > 0.01
    for dtype in (torch.float16, torch.bfloat16):
        low = m.to(dtype)
        truth = ((low == 0).sum().item() / nonzero, low.isinf().sum().item() / nonzero)
        assert shares(cast(dtype)) == truth
        assert dtype == torch.bfloat16 or min(truth) > 0.001


class TinyGradient(nn.Module):
    """A Linear whose output's gradient is `c`, of order 1e-7, its loss inside the forward as a
    task's is: through an upcast (`.float()`, as a loss in fp32) or a residual add into an fp32
    stream (autograd casts the add's gradient to the output's dtype)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.lin = nn.Linear(64, 64)
        self.c = 1e-7 * (torch.randn(512, 64) * 1.5).exp()

    def forward(self, x):
        y = self.lin(x)
        h = y.float() if self.path == "upcast" else x + y  # x: fp32
        return (h * self.c).sum()


@pytest.mark.parametrize("path", ["upcast", "residual"])
def test_fp16s_gradient_underflow_is_the_share_its_cast_flushed(path):
    """fp16 (loss scale 1): dy arrives in fp16, the cast having flushed what lies below fp16's
    half-smallest subnormal (2^-25), so it showed 0.0% flushed. The share is what the cast into
    fp16 flushed, computed here from the fp32 gradient: 21.5% of it; bf16's is none."""
    torch.manual_seed(0)
    net = TinyGradient(path)
    x = torch.randn(512, 64, requires_grad=True)
    for dtype in (torch.float16, torch.bfloat16):
        with ErrorProbe(net, 1, converted=False) as probe:
            with torch.autocast("cpu", dtype):
                loss = net(x)
            loss.backward()
        truth = (net.c.to(dtype) == 0).sum().item() / net.c.numel()
        assert (truth > 0.2) == (dtype == torch.float16), truth
        for direction in ("input_grad", "weight_grad"):
            dy = _at(probe.records(), "lin", direction)["operands"]["dy"]
            assert dy["underflow"] == truth, (dtype, direction, dy)
            assert dy["amax"] == net.c.abs().max().item()


def test_a_runs_fp16_gradient_underflow_is_visible(tmp_path):
    """A run, its model the task (the loss inside its forward): the 2-block GPT in fp16, its loss
    scale held at 1e-4, the output projections' dy, cast into fp16 from the fp32 residual
    stream's gradient, 32.7-33.3% flushed (it read 0.0%)."""
    from runner.run import run
    from tests.helpers import make_cfg
    from tests.test_fp4 import _gpt

    held = [f"precision.grad_scaler.{k}=0.0001" for k in ("init_scale", "max_scale")]
    summary = run(make_cfg(*_gpt("precision=fp16", width=32), *held), tmp_path)
    flushed = [
        r["operands"]["dy"]["underflow"]
        for r in summary["matmul_error"]
        if r["module"].endswith(("mlp.2", "proj")) and r["direction"] == "input_grad"
    ]
    assert len(flushed) == 4 and min(flushed) > 0.3, flushed
