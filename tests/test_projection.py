"""The projection (issue 33): a roofline per recorded op, held against a hand calculation, against
torchao's own roofline for the shapes of its float8 README table, against the fp8 question's
shape (slow when small, fast when wide, the crossover moving with the GPU), and in a run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.measure import batch_fit, gpus
from runner.measure import projection as P
from runner.measure.flops import PrecisionAudit
from runner.measure.matmuls import MatmulLog
from runner.measure.module_stack import ModuleStack

pytest.importorskip("torchao")


def _audit(model: nn.Module, step, mode: str) -> dict:
    """The audited step's record of `step()`, as Meter.audited keeps it."""
    stack = ModuleStack(model)
    log = MatmulLog(stack)
    with stack, PrecisionAudit(log):
        step()
    return {"mode": mode, "step": 1, "ops": log.records(), "traffic": log.traffic()}


class MatMul(nn.Module):
    def forward(self, a, b):
        return a @ b


@pytest.mark.parametrize(
    "mkn, bound", [((4096, 4096, 4096), "compute"), ((16384, 16, 16384), "memory")]
)
def test_a_pure_matmul_projects_as_the_hand_calculation(mkn, bound):
    m, k, n = mkn
    a = torch.empty(m, k, device="meta", dtype=torch.bfloat16)
    b = torch.empty(k, n, device="meta", dtype=torch.bfloat16)
    model = MatMul()
    stage = _audit(model, lambda: model(a, b), "bf16")
    gpu = gpus.spec("H100")
    # by hand: H100 SXM bf16 989.5 TFLOP/s × 0.78; 3.35 TB/s × 0.92; bf16 operands and output
    compute = 2 * m * k * n / (989.5e12 * 0.78)
    memory = (m * k + k * n + m * n) * 2 / (3.35e12 * 0.92)
    hand = max(compute, memory)
    assert (compute > memory) == (bound == "compute")
    projected = P.project_stage(stage, gpu)
    assert projected["step_time_s"] == pytest.approx(hand, rel=1e-9)
    assert projected["memory_bound_matmul_share"] == (1.0 if bound == "memory" else 0.0)


def _linear_step(m, k, n, mode, recipe="tensorwise", device="meta"):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = nn.Sequential(nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16))
    if mode == "fp8":
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    x = torch.empty(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    return _audit(model, lambda: model(x).backward(grad), mode)


# The README table's corners and its two worked examples (M, K, N of the forward)
README_SHAPES = [
    (1024, 2048, 1024),
    (4096, 8192, 16384),
    (1024, 1024, 1024),
    (16384, 16384, 16384),
    (2048, 4096, 8192),
    (8192, 1024, 16384),
]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_over_bf16_agrees_with_torchaos_roofline(recipe):
    from torchao.testing.training.roofline_utils import get_float8_mem_sympy, get_gemm_time_sympy

    gpu = gpus.torchao_spec("NVIDIA H100")
    for m, k, n in README_SHAPES:
        bf16 = P.project_stage(_linear_step(m, k, n, "bf16"), gpu)["step_time_s"]
        fp8 = P.project_stage(_linear_step(m, k, n, "fp8", recipe), gpu)["step_time_s"]
        theirs_bf16 = float(get_gemm_time_sympy(m, k, n, torch.bfloat16, None, None, "NVIDIA H100"))
        theirs_fp8 = float(
            get_gemm_time_sympy(m, k, n, torch.float8_e4m3fn, recipe, None, "NVIDIA H100")
        )
        theirs_fp8 += float(get_float8_mem_sympy(m, k, n, recipe, None, False, "NVIDIA H100"))
        assert bf16 / fp8 == pytest.approx(theirs_bf16 / theirs_fp8, rel=0.10), (m, k, n)


def _mlp_speedup(width: int, gpu: gpus.GpuSpec, tokens: int = 2048, depth: int = 2) -> float:
    from torchao.float8 import convert_to_float8_training

    times = {}
    for mode in ("bf16", "fp8"):
        layers = [nn.Linear(width, width, bias=False, device="meta") for _ in range(depth)]
        model = nn.Sequential(*layers).to(torch.bfloat16)
        if mode == "fp8":
            convert_to_float8_training(model)
        x = torch.empty(tokens, width, device="meta", dtype=torch.bfloat16, requires_grad=True)
        stage = _audit(model, lambda model=model, x=x: model(x).sum().backward(), mode)
        times[mode] = P.project_stage(stage, gpu)["step_time_s"]
    return times["bf16"] / times["fp8"]


def test_fp8_slows_a_tiny_model_speeds_a_wide_one_and_the_crossover_moves_with_the_gpu():
    h100, b200 = gpus.spec("H100"), gpus.spec("B200")
    assert _mlp_speedup(128, h100) < 1.0  # the casts' kernels outweigh GEMMs this small
    assert _mlp_speedup(8192, h100) > 1.2
    widths = list(range(512, 8193, 256))
    first = {
        gpu.name: next(w for w in widths if _mlp_speedup(w, gpu) > 1.0) for gpu in (h100, b200)
    }
    assert first["H100 SXM"] != first["B200"], first


def test_a_gpu_without_fp8_units_says_so():
    stage = _linear_step(256, 256, 256, "fp8")
    projected = P.project_stage(stage, gpus.spec("A100"))
    assert projected["step_time_s"] is None and "no fp8 units" in projected["why"]


def test_max_batch_solves_the_fit_for_the_gpus_memory():
    gpu = gpus.spec("H100")  # 80 GB less 10%
    assert batch_fit.fitted_max_batch([1024.0, 100.0], gpu) == int((80 * 1024 * 0.9 - 1024) // 100)
    coefficients, source = batch_fit.memory_coefficients(
        {"memory": {"total": 300.0, "activations": {"mb": 200.0}}}, 16
    )
    assert coefficients == [100.0, 12.5] and "accounted" in source


def test_a_run_with_runner_project_writes_the_projection(tmp_path):
    from runner.run import run
    from tests.helpers import TINY_BERT, make_cfg

    cfg = make_cfg(
        *TINY_BERT,
        "precision=bf16",
        "trainer.max_steps=3",
        "trainer.val_check_interval=0",
        "runner.project=[H100,B200]",
        "runner.project_precisions=[fp32]",
    )
    summary = run(cfg, tmp_path)
    projected = summary["projection"]
    assert set(projected) == {"H100 SXM", "B200"}
    for gpu in projected.values():
        bf16, fp32 = gpu["bf16"], gpu["fp32"]
        assert bf16["speedup_vs_bf16"] == pytest.approx(1.0)
        assert bf16["speedup_vs_fp32"] == pytest.approx(fp32["step_time_s"] / bf16["step_time_s"])
        assert bf16["tokens_per_s"] > 0 and 0 < bf16["mfu"] < 1 and bf16["max_batch"] > 8
        assert "never measured" in gpu["_assumptions"]["estimate"]
    # B200 moves bytes faster than H100: every op here is memory- or launch-bound
    assert projected["B200"]["bf16"]["step_time_s"] <= projected["H100 SXM"]["bf16"]["step_time_s"]


def test_a_projection_in_the_comparison_is_an_estimate_and_recommends_no_row(tmp_path, capsys):
    import json

    from runner.compare import compare
    from tests.test_compare import fake_job

    def projection(precision, step):
        return {"projection": {"H100 SXM": {precision: {"step_time_s": step, "mfu": 0.3}}}}

    fake_job(tmp_path / "0", "fp32", speed=100.0, summary=projection("fp32", 0.018))
    fake_job(tmp_path / "1", "bf16", speed=100.0, summary=projection("bf16", 0.010))
    fp32, bf16 = compare(tmp_path, wandb_log=False)
    # measured alike: no row is shown faster, whatever the projection says
    assert "— recommended" not in bf16.verdict.split("; projected on")[0]
    assert fp32.verdict.startswith("baseline — recommended")
    clause = bf16.verdict[bf16.verdict.index("projected on") :]
    assert clause.startswith("projected on H100 SXM: 1.80×") and "estimate" in clause
    assert "measured" not in clause and "recommended" not in clause
    md = (tmp_path / "compare.md").read_text().splitlines()
    header = [c.strip() for c in md[2].split("|")]
    column = header.index("projected H100 speedup (estimate)")
    assert [c.strip() for c in md[5].split("|")][column] == "1.80×"
    assert "projected H100 MFU (estimate)" in header
    rows = json.loads((tmp_path / "compare.json").read_text())
    assert rows[1]["projected_speedup"] == pytest.approx(1.8)
    # printed: one projected column, its header saying estimate, in the 80 columns
    printed = capsys.readouterr().out.splitlines()
    table = printed[: printed.index(f"fp32: {fp32.verdict}")]
    assert max(len(line.rstrip()) for line in table) <= 80
    assert any("H100 est." in line for line in table), table
    bf16_line = next(line for line in table if line.startswith("bf16 "))
    assert "1.80×" in bf16_line and "projected" not in bf16_line  # the clause is below, whole


def test_the_dashboard_draws_the_projection_as_an_estimate(tmp_path):
    """compare.png gains a column where the sweep projected onto a GPU: each row's projected
    speedup and MFU, titled as estimates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from runner.compare import compare, projected
    from tests.test_compare import fake_job

    for i, (precision, step) in enumerate((("fp32", 0.018), ("bf16", 0.010))):
        summary = {"projection": {"H100 SXM": {precision: {"step_time_s": step, "mfu": 0.3}}}}
        fake_job(tmp_path / str(i), precision, speed=100.0, summary=summary)
    groups = compare(tmp_path, wandb_log=False)
    assert projected.shown(groups)
    fig, ax = plt.subplots()
    projected.panel(ax, groups, "projected_speedup")
    assert (
        ax.get_title()
        == "projected H100 SXM speedup over its baseline's step (estimate, not measured)"
    )
    assert [t.get_text() for t in ax.texts] == ["1.00×", "1.80×"]
    plt.close(fig)
    assert (tmp_path / "compare.png").stat().st_size > 10_000
