"""precision=bf16_true (bf16 weights, gradients and optimizer state; its update rules) and the
optimizer state's precision (optim.state_dtype, optim=adamw8bit)."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from runner.config import PrecisionConfig
from runner.config.validation import validate
from runner.errors import UserError
from runner.precision import DeviceCaps, Precision
from runner.precision.bf16_true import stochastic_round
from runner.run import build, run, seed_everything
from runner.train.optim import AdamW, build_optimizer
from tests.helpers import load_last, make_cfg, read_metrics

NET = [
    "model=module",
    "model.net._target_=tests.test_matrix.MatrixNet",  # Linear 32→64, 64→64, head 64→8
    "dataset=blobs",
    "dataset.num_samples=1024",
    "dataset.batch_size=32",
    "trainer.progress_bar=false",
    "logger=none",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=0",
]
BF16_TRUE = ["precision=bf16_true"]


def _changed_share(run_dir, cfg) -> float:
    """The share of weights that differ, after training, from their bf16 start."""
    seed_everything(cfg.seed)  # as run() builds the model
    _, task = build(cfg)
    final = load_last(run_dir)["model"]
    start = {k: v.bfloat16() for k, v in task.state_dict().items()}
    changed = sum((final[k] != v).sum().item() for k, v in start.items())
    return changed / sum(v.numel() for v in start.values())


def test_below_bf16_spacing_plain_stalls_where_stochastic_rounding_and_kahan_train(tmp_path):
    """Adam's steps are about lr = 5e-5: below half of bf16's spacing (2⁻⁹ of a weight) for
    weights over ~0.03, most of them. Rounded to nearest they are lost; the other rules keep
    them, and reach the loss fp32 reaches (2.061 here; plain 2.079)."""
    steps = [
        "optim.optimizer.lr=5e-5",
        "optim.scheduler.warmup_steps=0",
        "optim.scheduler.decay=constant",
        "trainer.max_steps=30",
        "trainer.val_check_interval=30",
    ]
    changed, loss = {}, {}
    for update in ("plain", "stochastic_rounding", "kahan"):
        cfg = make_cfg(*NET, *BF16_TRUE, *steps, f"precision.update={update}")
        loss[update] = run(cfg, tmp_path / update)["eval_loss"]
        changed[update] = _changed_share(tmp_path / update, cfg)
    assert changed["plain"] < 0.25, changed  # measured 0.11
    assert changed["stochastic_rounding"] > 0.6 and changed["kahan"] > 0.6, changed  # 0.81, 0.88
    assert loss["stochastic_rounding"] < loss["plain"] - 0.01, loss
    assert loss["kahan"] < loss["plain"] - 0.01, loss


def test_bf16_true_halves_the_weights_and_bf16_state_halves_the_moments(tmp_path):
    three = [*NET, "trainer.max_steps=3"]
    fp32 = run(make_cfg(*three), tmp_path / "fp32")["memory"]
    true = run(make_cfg(*three, *BF16_TRUE), tmp_path / "bf16_true")["memory"]
    state = run(make_cfg(*three, "optim.state_dtype=bf16"), tmp_path / "state")["memory"]
    model = load_last(tmp_path / "bf16_true")["model"]
    assert {v.dtype for v in model.values()} == {torch.bfloat16}
    for category in ("params", "grads"):
        assert true[category]["by_dtype"] == {"bfloat16": fp32[category]["by_dtype"]["float32"] / 2}
    moments = fp32["optimizer"]["by_dtype"]["float32"]  # and a 4-byte step count per weight
    assert true["optimizer"]["by_dtype"]["bfloat16"] == pytest.approx(moments / 2, rel=1e-3)
    assert state["optimizer"]["by_dtype"]["bfloat16"] == pytest.approx(moments / 2, rel=1e-3)
    assert state["params"] == fp32["params"]  # fp32 weights, bf16 moments
    saved = load_last(tmp_path / "state")["optimizer"]["state"]
    assert {s["exp_avg"].dtype for s in saved.values()} == {torch.bfloat16}


class Task(nn.Module):
    """A task's shape: a net (its child), whose output the loss reads."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("keep_norms", [True, False])
def test_norms_and_islands_stay_fp32_and_the_forward_casts_at_their_edges(keep_norms):
    cfg = PrecisionConfig(mode="bf16_true", keep_norms_fp32=keep_norms)
    p = Precision(OmegaConf.structured(cfg), torch.device("cpu"))
    task = Task()
    p.prepare(task, ["net.2"])  # an fp32 island
    first, norm, island, head = task.net
    assert first.weight.dtype == head.weight.dtype == torch.bfloat16
    assert island.weight.dtype == torch.float32
    assert norm.weight.dtype == (torch.float32 if keep_norms else torch.bfloat16)
    seen = {}
    norm.register_forward_hook(lambda _m, _a, out: seen.update(norm=out.dtype))
    # a bf16 Linear given the island's fp32 output would fail: it computes in bf16
    head.register_forward_hook(lambda _m, _a, out: seen.update(head=out.dtype))
    out = task(torch.randn(3, 4))  # fp32 features: the first layer takes them in bf16
    assert seen == {"norm": torch.bfloat16, "head": torch.bfloat16}
    assert out.dtype == torch.float32  # for the loss
    assert p.dtype is None  # no autocast
    # MFU against bf16's peak, or fp32's where the fast CPU kernels compute bf16 matmuls in fp32
    assert p.peak_mode.compute == ("fp32" if p.emulates("bf16_true") else "bf16")
    p.close()


def test_the_runner_adamw_is_torch_adamw_in_fp32():
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(8, 8)) for _ in range(2)]
    theirs = [nn.Parameter(w.detach().clone()) for w in ours]
    opt = AdamW(ours, lr=1e-2, weight_decay=0.1, state_dtype=torch.float32)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(5):
        grads = [torch.randn(8, 8) for _ in ours]
        for params, optimizer in ((ours, opt), (theirs, ref)):
            for w, g in zip(params, grads, strict=True):
                w.grad = g.clone()
            optimizer.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("weights", "moments"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)]
)
def test_the_runner_adamw_loads_its_state_in_the_dtypes_it_saved(weights, moments):
    """torch's load_state_dict casts the state to each weight's dtype."""
    w = nn.Parameter(torch.randn(4, 4).to(weights))
    w.grad = torch.randn(4, 4).to(weights)
    saved = AdamW([w], state_dtype=moments)
    saved.step()
    loaded = AdamW([w], state_dtype=moments)
    loaded.load_state_dict(saved.state_dict())
    for key in ("exp_avg", "exp_avg_sq"):
        assert loaded.state[w][key].dtype == moments
        assert torch.equal(loaded.state[w][key], saved.state[w][key])


def test_stochastic_rounding_is_unbiased_where_rounding_to_nearest_loses_the_update():
    x = torch.full((200_000,), 1 + 2**-10)  # a quarter of bf16's spacing (2⁻⁷) above 1
    assert x.bfloat16().float().mean().item() == 1.0
    assert stochastic_round(x).float().mean().item() == pytest.approx(1 + 2**-10, abs=2e-5)
    assert set(stochastic_round(x).float().unique().tolist()) == {1.0, 1 + 2**-7}


@pytest.mark.parametrize("update", ["kahan", "stochastic_rounding"])
def test_bf16_true_resumes_exactly_with_its_compensation_and_random_state(tmp_path, update):
    common = [*NET, *BF16_TRUE, f"precision.update={update}", "optim.optimizer.lr=1e-4"]
    run(make_cfg(*common, "trainer.max_steps=6"), tmp_path / "straight")
    run(make_cfg(*common, "trainer.max_steps=3"), tmp_path / "resumed")
    run(make_cfg(*common, "trainer.max_steps=6", "trainer.resume=auto"), tmp_path / "resumed")
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    straight, resumed = load_last(tmp_path / "straight"), load_last(tmp_path / "resumed")
    for name, tensor in straight["model"].items():
        assert torch.equal(resumed["model"][name], tensor), name
    for i, state in straight["optimizer"]["state"].items():
        assert state.keys() == resumed["optimizer"]["state"][i].keys()
        for key, value in state.items():
            assert torch.equal(resumed["optimizer"]["state"][i][key], value), (i, key)
    if update == "kahan":  # bf16, and holding what the weights could not take
        compensation = [s["compensation"] for s in straight["optimizer"]["state"].values()]
        assert all(c.dtype == torch.bfloat16 for c in compensation)
        assert any(c.abs().sum() > 0 for c in compensation)


def test_adamw8bit_quarters_the_moments_and_resumes_from_a_plain_checkpoint(tmp_path, monkeypatch):
    # torchao compiles its step per weight shape (tens of seconds a shape on a CPU, cold); the
    # same function runs eagerly here
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    common = [*NET, "optim=adamw8bit"]
    run(make_cfg(*common, "trainer.max_steps=4"), tmp_path / "straight")
    run(make_cfg(*common, "trainer.max_steps=2"), tmp_path / "resumed")
    run(make_cfg(*common, "trainer.max_steps=4", "trainer.resume=auto"), tmp_path / "resumed")
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    state = load_last(tmp_path / "straight")["optimizer"]["state"]
    quantized = [s for s in state.values() if isinstance(s["exp_avg"], dict)]
    assert len(quantized) == 1  # net.blocks.2.weight, 64×64: torchao quantizes ≥ 4096 elements
    for moment in ("exp_avg", "exp_avg_sq"):
        parts = quantized[0][moment]["tensors"]
        assert parts["codes"].dtype == torch.uint8 and parts["codes"].numel() == 4096
        size = sum(t.numel() * t.element_size() for k, t in parts.items() if k != "qmap")
        assert size / (4096 * 4) == pytest.approx(0.25, abs=0.005)  # 1 byte each, 4 per block
    tensors = [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    tensors += [
        t for s in quantized for m in ("exp_avg", "exp_avg_sq") for t in s[m]["tensors"].values()
    ]
    assert {type(t) for t in tensors} == {torch.Tensor}  # loads with weights_only, no torchao


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["precision=bf16_true", "trainer.strategy=fsdp"], "with trainer.strategy=fsdp use"),
        (["precision=bf16", "precision.update=kahan"], "applies to a mode that holds bf16 weights"),
        (["precision=bf16_true", "precision.update=nearest"], "plain, stochastic_rounding, kahan"),
        (["optim=adamw8bit", "optim.state_dtype=bf16"], "applies to optim=adamw, not torchao"),
        (["optim.state_dtype=fp16"], "fp32, bf16 or null"),
        (["precision=bf16_true", "precision.update=kahan", "optim=adamw8bit"], "needs optim=adamw"),
        (["optim.state_dtype=bf16", "+optim.optimizer.amsgrad=true"], "lr, betas, eps, wd only"),
    ],
)
def test_what_cannot_work_is_refused_before_the_run(overrides, message):
    with pytest.raises(UserError, match=message):
        validate(make_cfg(*NET, *overrides))


def test_a_missing_torchao_is_one_clear_line(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name)
    )
    cfg = make_cfg(*NET, "optim=adamw8bit").optim
    with pytest.raises(UserError, match="needs torchao: scripts/setup.sh installs"):
        build_optimizer(cfg, [nn.Parameter(torch.zeros(2, 2))])


def test_torchao_s_lines_about_kernels_a_cpu_cannot_load_are_silenced(caplog):
    build_optimizer(make_cfg(*NET, "optim=adamw8bit").optim, [nn.Parameter(torch.zeros(2, 2))])
    torchao = logging.getLogger("torchao")  # as errors: precision=fp8 may have raised its level
    torchao.error("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
    torchao.error("something else")
    assert [r.getMessage() for r in caplog.records if r.name == "torchao"] == ["something else"]


def test_bf16_true_is_refused_on_a_gpu_without_bf16_like_bf16():
    caps = DeviceCaps("cuda", "Tesla V100", cuda_capability=(7, 0))
    cfg = OmegaConf.structured(PrecisionConfig(mode="bf16_true"))
    with pytest.raises(UserError, match="bf16 tensor cores need ≥ 8.0"):
        Precision(cfg, torch.device("cpu"), caps)
