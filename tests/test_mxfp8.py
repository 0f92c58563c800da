"""precision=mxfp8 (torchao's MXFP8Linear, emulated on a CPU): what differs from fp8. The rules,
the report, convergence next to bf16, the audit, resume, staged and islands are fp8's and run in
both formats in test_fp8.py; compile, DDP and FSDP in the pairwise matrix (test_matrix.py)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from runner.config import PrecisionConfig
from runner.errors import UserError
from runner.measure.flops import cpu_matmul_tflops, peak_tflops, utilisation
from runner.precision import DeviceCaps, Precision, mode_of
from runner.run import run
from tests.helpers import TINY_BERT, make_cfg

pytest.importorskip("torchao")

H100 = DeviceCaps("cuda", "NVIDIA H100 80GB HBM3", cuda_capability=(9, 0))
B200 = DeviceCaps("cuda", "NVIDIA B200", cuda_capability=(10, 0))
CPU = DeviceCaps("cpu", "AMD EPYC", cpu_flags=frozenset({"avx2"}))


def _precision(caps: DeviceCaps = CPU, **keys) -> Precision:
    cfg = PrecisionConfig(mode="mxfp8", **keys)
    cfg.fp8.skip = []
    return Precision(OmegaConf.structured(cfg), torch.device("cpu"), caps)


def _mxfp8_linear() -> type:
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    return MXFP8Linear


def test_a_linear_becomes_mxfp8linear_with_its_own_weights_and_bias():
    """The converted layer computes in MXFP8 (not the Linear's numbers, but within MXFP8's
    rounding of them) and adds the Linear's bias: torchao's weight-wrapping conversion
    (`quantize_` with MXFP8TrainingOpConfig) drops it."""
    from torchao.quantization.quantize_.common import KernelPreference

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32))
    nn.init.constant_(net[0].bias, 3.0)
    plain = nn.Linear(64, 32)
    plain.load_state_dict(net[0].state_dict())
    weight, bias = net[0].weight, net[0].bias
    precision = _precision()
    precision.prepare(net)
    layer = net[0]
    assert type(layer) is _mxfp8_linear() and layer.kernel_preference == KernelPreference.EMULATED
    assert layer.weight is weight and layer.bias is bias  # the optimizer steps the same tensors
    x = torch.randn(32, 64)
    with precision.autocast():
        got = layer(x)
        want = plain(x)
    assert got.dtype == torch.bfloat16  # as the GPU kernel returns it
    assert not torch.equal(got, want)
    torch.testing.assert_close(got.float(), want.float(), rtol=0.1, atol=0.15)
    precision.close()


def test_dimensions_must_be_multiples_of_its_block_of_32():
    """64×48 and 48×32 would convert in fp8 (multiples of 16); MXFP8 scales blocks of 32."""
    net = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 48), nn.Linear(48, 32), nn.Linear(32, 32))
    precision = _precision()
    precision.prepare(net)
    assert [type(m) is _mxfp8_linear() for m in net] == [True, False, False, True]
    assert precision.converted.skipped == {
        "1": "dimensions 64×48 are not multiples of 32",
        "2": "dimensions 48×32 are not multiples of 32",
    }
    precision.close()


def test_rows_that_are_not_a_multiple_of_32_are_padded_for_its_blocks(tmp_path):
    """40 rows a micro-batch: the weight's gradient GEMM scales them in blocks of 32, so they are
    padded to 64 (to 48, a multiple of 16 only, torchao refuses them)."""
    cfg = [
        "model=module",
        "model.net._target_=tests.test_matrix.MatrixNet",  # Linear 32→64, 64→64, head 64→8
        "dataset=blobs",
        "dataset.num_samples=240",
        "dataset.batch_size=40",
        "trainer.max_steps=2",
        "trainer.progress_bar=false",
        "logger=none",
        "precision=mxfp8",
        "precision.fp8.skip=[]",
    ]
    summary = run(make_cfg(*cfg), tmp_path)
    assert summary["status"] == "completed"
    assert summary["converted"]["converted"] == ["net.blocks.0", "net.blocks.2"]


def test_compiled_with_a_dynamic_row_count_its_gradients_are_eagers():
    """20 rows padded to one block of 32, the row count dynamic (as after a run of other batch
    sizes in the same process): Inductor's CPU code for the emulation got the weight's gradient
    wrong, so the emulation runs outside the compiled graph."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64))
    precision = _precision()
    precision.prepare(net)
    compiled = torch.compile(net, dynamic=True)
    for rows in (40, 20):
        x = torch.randn(rows, 64)
        grads = []
        for forward in (net, compiled):
            net.zero_grad()
            with precision.autocast():
                out = forward(x)
            out.float().pow(2).sum().backward()
            grads.append(net[0].weight.grad.clone())
        assert torch.equal(*grads), rows
    precision.close()


def test_a_gpu_before_sm100_refuses_it_unless_emulated():
    from torchao.quantization.quantize_.common import KernelPreference

    with pytest.raises(UserError, match=r"precision=mxfp8 is not supported natively here: .*10\.0"):
        _precision(H100)
    for caps, kernels in ((H100, KernelPreference.EMULATED), (B200, KernelPreference.AUTO)):
        net = nn.Sequential(nn.Linear(32, 32))
        precision = _precision(caps, allow_emulated=True)
        precision.prepare(net)
        assert net[0].kernel_preference == kernels, caps.name
        precision.close()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["precision=mxfp8", "precision.fp8.recipe=rowwise"],
            "precision.fp8.recipe='rowwise' is invalid: applies to precision=fp8 only",
        ),
        (
            ["precision=mxfp8", "precision.fp8.all_gather=true"],
            "precision.fp8.all_gather=True is invalid: applies to precision=fp8 only",
        ),
        (
            ["precision=staged", "precision.stages=[{mode:fp8,until_step:2},{mode:mxfp8}]"],
            "a run converts its Linears once: fp8 stages or mxfp8 stages, not both",
        ),
    ],
)
def test_fp8s_own_keys_and_a_mix_of_formats_are_one_clear_line(tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        run(make_cfg(*TINY_BERT, *overrides), tmp_path)


def test_its_peak_is_blackwells_and_a_cpu_measures_none(tmp_path):
    """A CPU has no MXFP8 kernels to time (not fp32's rate under mxfp8's name); B200's MXFP8
    runs at its fp8 rate, and its MFU is given against bf16's peak too, as fp8's."""
    assert peak_tflops(B200, mode_of("mxfp8"), tmp_path) == 4500
    assert peak_tflops(H100, mode_of("mxfp8"), tmp_path) is None
    assert cpu_matmul_tflops(CPU, mode_of("mxfp8"), tmp_path) is None
    u = utilisation(
        {"flops_per_step": 1125e12, "step_time_s": 1.0}, B200, mode_of("mxfp8"), tmp_path
    )
    assert u["mfu"] == pytest.approx(0.25) and u["mfu_vs_bf16_peak"] == pytest.approx(0.5)
