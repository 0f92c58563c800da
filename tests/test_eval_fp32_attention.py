"""The fp32 evaluation's check sees attention (issue 39). Evaluation runs under
`torch.inference_mode()`, where autograd's keys are off and matmul, einsum,
scaled_dot_product_attention and the convNd functions reach the audit's dispatch mode whole,
not as the mm/bmm/convolution/flash kernels they decompose into elsewhere: each has a FLOP
formula of its own (runner/measure/flop_formulas.py), so the precision manifest records what it
computed in and `runner.eval_precisions`' fp32 row is held to fp32 for it, as for a Linear.
None of these tests depends on the CPU kind: the evaluations run PyTorch's own kernels (the fast
CPU kernels are installed only while `fit` lasts), and the check reads the operands' dtypes."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.measure.flops import PrecisionAudit
from runner.measure.manifest import EVALUATION, _evaluation_mismatches
from runner.measure.matmuls import recording
from runner.run import run
from tests.helpers import make_cfg, module_run

OPS = ("matmul", "einsum", "scaled_dot_product_attention", "conv1d")
NET = "tests.test_eval_fp32_attention.AttentionNet"


class AttentionNet(nn.Module):
    """x @ xᵀ, an einsum, scaled-dot-product attention and a conv1d, computed in `compute` (as a
    net that runs its attention in bf16 whatever it is asked), each result back in fp32 before
    the head: no module hands on bf16, so only the matmuls themselves tell."""

    def __init__(self, compute: str = "float32"):
        super().__init__()
        self.compute = getattr(torch, compute)
        self.kernel = nn.Parameter(torch.randn(2, 2, 3) / 3)  # conv1d: 2 → 2 channels, width 3
        self.head = nn.Linear(4 + 4 + 8 + 8, 3)

    def forward(self, x):  # x: (batch, 8)
        q = x.view(-1, 1, 2, 4).to(self.compute)  # (batch, heads, tokens, features)
        scores = q @ q.transpose(-1, -2)
        pairs = torch.einsum("bhsd,bhtd->bhst", q, q.flip(-2))
        attended = F.scaled_dot_product_attention(q, q, q)
        h = x.view(-1, 2, 4).to(self.compute)
        mixed = F.conv1d(h, self.kernel.to(h.dtype), padding=1)
        parts = (scores, pairs, attended, mixed)
        return self.head(torch.cat([p.flatten(1).float() for p in parts], 1))


def evaluated(net: nn.Module, context=contextlib.nullcontext) -> dict:
    """One batch through `net` as the fp32 row's first batch is recorded: under inference_mode,
    the record outside the row's precision context (runner/answers/inference.py)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), recording(net) as seen, context():
        net(x)
    return seen


def flagged(op: str, computed: str = "bf16") -> str:
    return f"{EVALUATION} computes in fp32; the model's {op} ran in {computed} on bf16"


def test_a_bf16_net_s_attention_fails_the_fp32_check():
    """A net that computes its attention in bf16: each of its four matmul-like ops is one
    mismatch (the Linear head, on fp32, is none), and nothing else is."""
    seen = evaluated(AttentionNet("bfloat16"))
    assert {(r["op"], r["format"], tuple(r["inputs"])) for r in seen["ops"]} == {
        *((op, "bf16", ("bf16",)) for op in OPS),
        ("linear", "fp32", ("fp32",)),
    }
    assert sorted(_evaluation_mismatches(seen)) == sorted(flagged(op) for op in OPS)


def test_attention_under_a_bf16_autocast_fails_the_fp32_check():
    """An fp32 net evaluated under bf16 autocast: autocast casts matmul, attention and conv1d
    before the audit sees them, and each is flagged. (einsum is not on autocast's list: it is
    cast where it decomposes into bmm, below the audit's dispatch mode, so the audited batch
    computes it in fp32; a bf16 einsum is the test above.)"""
    mismatches = _evaluation_mismatches(
        evaluated(AttentionNet(), lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    )
    for op in ("matmul", "scaled_dot_product_attention", "conv1d"):
        assert flagged(op) in mismatches, op


def test_attention_in_fp32_passes_the_fp32_check():
    seen = evaluated(AttentionNet())
    assert {(r["op"], r["format"], tuple(r["inputs"])) for r in seen["ops"]} == {
        (op, "fp32", ("fp32",)) for op in (*OPS, "linear")
    }
    assert _evaluation_mismatches(seen) == []


def _r(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape)))


WHOLE = {
    "matmul 4-D": lambda: _r(2, 3, 5, 8) @ _r(2, 3, 8, 5),
    "matmul broadcast": lambda: _r(2, 3, 5, 8) @ _r(3, 8, 6),
    "matmul 1-D": lambda: _r(7) @ _r(3, 7, 2),
    "matmul dot": lambda: _r(7) @ _r(7),
    "matmul mv": lambda: _r(4, 7) @ _r(7),
    "einsum": lambda: torch.einsum("bhsd,bhtd->bhst", _r(2, 3, 5, 8), _r(2, 3, 6, 8)),
    "einsum implicit": lambda: torch.einsum("ij,jk", _r(4, 5), _r(5, 6)),
    "einsum ellipsis": lambda: torch.einsum("...ij,...jk->...ik", _r(2, 3, 4, 5), _r(3, 5, 6)),
    "einsum summed first": lambda: torch.einsum("ij,jk->k", _r(4, 5), _r(5, 6)),
    "einsum three": lambda: torch.einsum("bn,anm,bm->ba", _r(3, 4), _r(5, 4, 6), _r(3, 6)),
    "einsum path": lambda: torch.ops.aten.einsum(
        "ij,jk,kl->il", [_r(4, 5), _r(5, 6), _r(6, 7)], path=[1, 2, 0, 1]
    ),
    "sdpa": lambda: F.scaled_dot_product_attention(_r(2, 3, 5, 8), _r(2, 3, 5, 8), _r(2, 3, 5, 8)),
    "sdpa gqa": lambda: F.scaled_dot_product_attention(
        _r(2, 4, 5, 8), _r(2, 2, 7, 8), _r(2, 2, 7, 3), enable_gqa=True
    ),
    "sdpa 3-D": lambda: F.scaled_dot_product_attention(_r(3, 5, 8), _r(3, 7, 8), _r(3, 7, 4)),
    "conv1d": lambda: F.conv1d(_r(2, 4, 10), _r(6, 2, 3), padding="same", groups=2),
    "conv1d unbatched": lambda: F.conv1d(_r(4, 10), _r(6, 4, 3)),
    "conv2d": lambda: F.conv2d(_r(2, 4, 6, 6), _r(6, 4, 3, 3), stride=2),
    "conv_transpose2d": lambda: F.conv_transpose2d(_r(2, 4, 5, 5), _r(4, 3, 3, 3), groups=2),
}


@pytest.mark.parametrize("op", WHOLE)
def test_an_op_counts_the_same_whole_under_inference_mode_as_decomposed(op):
    """Under no_grad the op decomposes into the kernels torch's formulas count (bmm, mm,
    convolution, the CPU flash kernel); under inference_mode it arrives whole: the same FLOPs."""
    counts = []
    for context in (torch.inference_mode, torch.no_grad):
        with context(), PrecisionAudit() as audit:
            WHOLE[op]()
        counts.append(audit.report()["flops_per_step"])
    whole, decomposed = counts
    assert whole == decomposed > 0


def test_the_audit_reads_an_einsum_s_dtype_off_its_operand_list():
    """einsum takes its operands as a list: the audit's FLOPs by dtype are theirs, bf16 (not
    None, which would leave them out of the low-precision share and of `fp32_ops`)."""
    with torch.inference_mode(), PrecisionAudit() as audit:
        torch.einsum("ij,jk->ik", _r(4, 5).bfloat16(), _r(5, 6).bfloat16())
    assert dict(audit.flops) == {("einsum", torch.bfloat16): 2 * 4 * 5 * 6}
    assert audit.report()["low_precision_flop_share"] == 1.0


def test_an_elementwise_einsum_is_no_matmul():
    """An outer product multiplies elementwise (torch runs `mul`, no bmm): not counted either way."""
    with torch.inference_mode(), PrecisionAudit() as audit:
        torch.einsum("i,j->ij", _r(4), _r(5))
    assert audit.report()["flops_per_step"] == 0


def _trained(tmp_path, compute: str) -> dict:
    """model=module: the net trained two steps in bf16, then `runner.eval_precisions=[fp32]`."""
    cfg = make_cfg(
        *module_run(NET, "precision=bf16", f"+model.net.compute={compute}"),
        "runner.eval_precisions=[fp32]",
        "dataset.validation._target_=tests.test_own_model.pairs",
    )
    return run(cfg, tmp_path)


def test_the_trainer_s_fp32_evaluation_flags_a_net_s_bf16_attention(tmp_path):
    """The real path: after training, the fp32 row of runner.eval_precisions (the trainer's
    evaluation loop, under inference_mode) breaks the plan once for each bf16 op."""
    summary = _trained(tmp_path, "bfloat16")
    mismatches = summary["precision_manifest"]["mismatches"]
    evaluation = [m for m in mismatches if m.startswith(EVALUATION)]
    assert sorted(evaluation) == sorted(
        f"{EVALUATION} computes in fp32; net's {op} ran in bf16 on bf16" for op in OPS
    )
    assert summary["plan_held"] is False
    assert summary["eval_precisions"]["fp32"]["status"] == "ok"


def test_the_trainer_s_fp32_evaluation_records_attention_in_fp32(tmp_path):
    summary = _trained(tmp_path, "float32")
    modules = summary["precision_manifest"]["evaluation"]["fp32"]["modules"]
    assert {(o["op"], o["format"]) for o in modules["net"]["ops"]} == {(op, "fp32") for op in OPS}
    assert all(o["flops"] > 0 for o in modules["net"]["ops"])
    assert summary["plan_held"] is True
