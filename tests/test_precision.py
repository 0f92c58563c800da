"""The precision policy: DESIGN.md's AMP invariants 1, 2, 4, 5, 7, 8 and 9, each shown on real runs."""

from __future__ import annotations

import pytest
import torch

from runner.config import PrecisionConfig
from runner.errors import UserError
from runner.precision import DeviceCaps, Precision
from runner.run import build, run, seed_everything
from tests import probes
from tests.helpers import TINY_MLP, load_last, make_cfg, read_metrics

CPU = torch.device("cpu")


def _precision(mode: str, **caps) -> Precision:
    return Precision(PrecisionConfig(mode=mode), CPU, DeviceCaps(**caps) if caps else None)


@pytest.mark.parametrize("mode", ["fp32", "tf32", "fp16", "bf16"])
def test_autocast_wraps_forward_and_eval_only_and_weights_stay_fp32(tmp_path, mode):
    """Invariants 1, 2 and 8."""
    probes.EVENTS.clear()
    cfg = make_cfg(
        *TINY_MLP,
        f"precision={mode}",
        "model._target_=tests.probes.ProbeMLP",
        "trainer.max_steps=2",
        "trainer.accumulate_grad_batches=2",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
    )
    run(cfg, tmp_path)
    mixed = mode in ("fp16", "bf16")
    forward = [e for kind, e in probes.EVENTS if kind == "forward"]
    backward = [e for kind, e in probes.EVENTS if kind == "backward"]
    if mode == "fp16":  # fp16 health's fp32 reference on the first micro-batch, autocast off
        reference, forward, backward = forward[0], forward[1:], backward[1:]
        assert not reference["autocast"] and reference["input_dtype"] == torch.float32
    evals = [e for kind, e in probes.EVENTS if kind == "eval"]
    assert len(forward) == 4 and len(backward) == 4 and len(evals) == 1
    assert all(e["autocast"] == mixed for e in forward)
    assert all(e["input_dtype"] == torch.float32 for e in forward)  # inputs are not cast by hand
    assert all(e["weight_dtype"] == torch.float32 for e in forward)  # master weights stay fp32
    assert not any(e["autocast"] for e in backward)  # backward runs outside autocast
    assert evals[0]["autocast"] == mixed and evals[0]["inference"]
    weights = load_last(tmp_path)["model"]
    assert all(t.dtype == torch.float32 for t in weights.values())


def test_only_fp16_has_a_grad_scaler():
    assert _precision("fp16").scaler is not None
    for mode in ("fp32", "tf32", "bf16"):
        assert _precision(mode).scaler is None


def test_matmul_precision_is_set_explicitly_and_restored():
    """Invariant 9: tf32 → "high", fp32 → "highest" even after a tf32 job left "high" behind."""
    torch.set_float32_matmul_precision("highest")
    tf32 = _precision("tf32")
    assert torch.get_float32_matmul_precision() == "high"
    fp32 = _precision("fp32")  # as the next job of a multirun would
    assert torch.get_float32_matmul_precision() == "highest"
    fp32.close()
    assert torch.get_float32_matmul_precision() == "high"
    tf32.close()
    assert torch.get_float32_matmul_precision() == "highest"


V100 = dict(type="cuda", name="Tesla V100", cuda_capability=(7, 0))
A100 = dict(type="cuda", name="A100", cuda_capability=(8, 0))
T4 = dict(type="cuda", name="Tesla T4", cuda_capability=(7, 5))
OLD_CPU = dict(type="cpu", name="old CPU", cpu_flags=frozenset({"avx2"}))
AMX_CPU = dict(type="cpu", name="Xeon", cpu_flags=frozenset({"amx_bf16", "avx512_bf16"}))


def test_auto_picks_the_best_native_mode():
    assert DeviceCaps(**A100).best_mode()[0] == "bf16"
    assert DeviceCaps(**T4).best_mode()[0] == "fp16"
    assert DeviceCaps(**AMX_CPU).best_mode()[0] == "bf16"
    mode, why = DeviceCaps(**OLD_CPU).best_mode()
    assert mode == "fp32" and "old CPU" in why
    auto = _precision("auto", **AMX_CPU)
    assert (auto.requested, auto.mode) == ("auto", "bf16") and "AMX_BF16" in auto.describe()


AUTO_PICKS = {"avx2": "fp32", "avx512_bf16": "bf16", "amx": "bf16"}


def test_a_run_sees_the_cpu_kind_it_is_given(tmp_path, cpu_kind):
    """AMP_RUNNER_CPU_KIND decides what a run's `auto` picks, whatever this machine is, and the
    summary's device name says the kind was set."""
    summary = run(make_cfg(*TINY_MLP, "precision=auto", "trainer.max_steps=1"), tmp_path)
    assert summary["precision"] == AUTO_PICKS[cpu_kind]
    assert summary["device_name"].endswith(f"(as {cpu_kind}: AMP_RUNNER_CPU_KIND)")


def test_an_unknown_cpu_kind_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("AMP_RUNNER_CPU_KIND", "zen9")
    with pytest.raises(
        UserError,
        match=r"AMP_RUNNER_CPU_KIND=zen9 is not a CPU kind: use one of "
        r"avx2, avx512_bf16, amx or native",
    ):
        run(make_cfg(*TINY_MLP, "trainer.max_steps=1"), tmp_path)


def test_bf16_on_a_gpu_without_it_is_refused_with_the_reason():
    with pytest.raises(
        UserError, match=r"precision=bf16 is not supported natively here: Tesla V100"
    ):
        Precision(PrecisionConfig(mode="bf16"), torch.device("cuda"), DeviceCaps(**V100))
    with pytest.raises(UserError, match="tf32"):
        Precision(PrecisionConfig(mode="tf32"), torch.device("cuda"), DeviceCaps(**T4))


def test_emulated_modes_on_a_cpu_run_with_a_warning():
    p = _precision("bf16", **OLD_CPU)
    assert p.mode == "bf16" and "emulated" in p.warnings[0]
    assert "no TF32" in _precision("tf32", **AMX_CPU).warnings[0]


class _Spy:
    """Records GradScaler calls and optimizer steps, in order; the real methods still run."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for owner, name, label in (
            *((torch.amp.GradScaler, n, n) for n in ("scale", "unscale_", "step", "update")),
            (torch.optim.AdamW, "step", "optimizer.step"),
        ):
            original = getattr(owner, name)

            def wrapped(obj, *args, _label=label, _original=original, **kwargs):
                self.calls.append(_label)
                return _original(obj, *args, **kwargs)

            monkeypatch.setattr(owner, name, wrapped)


def expected_step(micro_batches: int, optimizers: int, fused: bool) -> list[str]:
    """One optimizer step: k × scale, unscale_ per optimizer, each optimizer steps (through
    scaler.step, or directly with the skip flag when fused), update once."""
    through_scaler = [] if fused else ["step"]
    return (
        ["scale"] * micro_batches
        + ["unscale_"] * optimizers
        + (through_scaler + ["optimizer.step"]) * optimizers
        + ["update"]
    )


@pytest.mark.parametrize("fused", [True, False])
def test_accumulation_scales_every_micro_batch_and_steps_once(tmp_path, monkeypatch, fused):
    """Invariants 3 and 4: per optimizer step, k × scale, then unscale_ → step → update once."""
    spy = _Spy(monkeypatch)
    cfg = make_cfg(
        *TINY_MLP,
        "precision=fp16",
        "trainer.max_steps=3",
        "trainer.accumulate_grad_batches=3",
        f"optim.optimizer.fused={fused}",
    )
    run(cfg, tmp_path)
    assert spy.calls == expected_step(3, 1, fused) * 3


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_a_fused_step_never_reads_the_device(monkeypatch, mode):
    """With fused AdamW the skip decision stays on the device: a step, taken or skipped, reads
    no tensor value on the host (the trainer reads the flag later, once more work is queued)."""
    precision = _precision(mode)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)

    def no_read(*_args, **_kwargs):
        raise AssertionError("the step read a value from the device")

    for poisoned in (False, True):
        before = [p.detach().clone() for p in model.parameters()]
        with precision.autocast():
            loss = model(torch.ones(3, 4)).float().mean()
        precision.backward([loss * (float("inf") if poisoned else 1.0)])
        with monkeypatch.context() as m:
            for name in ("item", "__bool__", "tolist"):
                m.setattr(torch.Tensor, name, no_read)
            result = precision.step([optimizer], list(model.parameters()), 1.0, loss=loss)
        optimizer.zero_grad()
        changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)]
        assert result.skipped.item() == float(poisoned)
        assert all(changed) if not poisoned else not any(changed)
    assert all(s["step"].item() == 1 for s in optimizer.state.values())  # the skip did not count


@pytest.mark.parametrize("fused", [True, False])
def test_huge_initial_scale_skips_steps_without_touching_weights(tmp_path, fused):
    """Invariant 5: each overflowing step is skipped, counted and logged; the scale halves; the
    LR schedule stays put; the weights are those of the initialisation."""
    overrides = [*TINY_MLP, "precision=fp16", "precision.grad_scaler.init_scale=1e30"]
    overrides.append(f"optim.optimizer.fused={fused}")
    cfg = make_cfg(*overrides, "trainer.max_steps=6", "trainer.log_every_n_steps=1")
    summary = run(cfg, tmp_path)
    rows = read_metrics(tmp_path)
    assert [r["skipped"] for r in rows] == [True] * 6
    assert [r["skipped_total"] for r in rows] == list(range(1, 7))
    assert summary["skipped_steps"] == 6
    scales = [r["loss_scale"] for r in rows]
    assert scales[0] == pytest.approx(1e30) and all(
        b == a / 2 for a, b in zip(scales, scales[1:], strict=False)
    )
    assert len({r["lr"] for r in rows}) == 1  # the warm-up did not advance
    seed_everything(cfg.seed)
    _, initial = build(cfg)
    saved = load_last(tmp_path)
    for name, tensor in initial.state_dict().items():
        assert torch.equal(saved["model"][name], tensor), name
    # AdamW never stepped: no state (foreach), or a step count of 0 and zero moments (fused)
    for state in saved["optimizer"]["state"].values():
        assert state["step"] == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()


def test_training_recovers_after_skips_and_the_schedule_resumes(tmp_path):
    cfg = make_cfg(
        *TINY_MLP,
        "precision=fp16",
        "precision.grad_scaler.init_scale=1e12",
        "trainer.max_steps=40",
        "trainer.log_every_n_steps=1",
    )
    run(cfg, tmp_path)
    rows = read_metrics(tmp_path)
    skipped = [r["skipped"] for r in rows]
    first_ok = skipped.index(False)
    assert first_ok > 0 and not any(skipped[first_ok:])
    assert rows[first_ok]["lr"] == rows[0]["lr"] < rows[first_ok + 1]["lr"]


def test_fp16_grad_norm_is_logged_unscaled_and_before_clipping(tmp_path):
    """Invariant 4: with clipping on, fp16's logged norm matches fp32's (not scale × norm)."""
    common = [*TINY_MLP, "trainer.max_steps=5", "trainer.log_every_n_steps=1"]
    common += ["trainer.gradient_clip_val=0.05"]
    run(make_cfg(*common, "precision=fp32"), tmp_path / "fp32")
    run(make_cfg(*common, "precision=fp16"), tmp_path / "fp16")
    fp32, fp16 = read_metrics(tmp_path / "fp32"), read_metrics(tmp_path / "fp16")
    assert not any(r["skipped"] for r in fp16) and fp16[0]["loss_scale"] == 65536.0
    for a, b in zip(fp32, fp16, strict=True):
        assert a["grad_norm"] > 0.05  # measured before clipping
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-2)


def test_checkpoint_carries_the_loss_scale(tmp_path):
    """Invariant 7."""
    cfg = make_cfg(
        *TINY_MLP,
        "precision=fp16",
        "precision.grad_scaler.init_scale=1e8",
        "precision.grad_scaler.growth_interval=3",
        "trainer.max_steps=12",
    )
    summary = run(cfg, tmp_path)
    saved = load_last(tmp_path)
    assert set(saved) >= {"model", "optimizer", "scaler", "step"} and saved["step"] == 12
    assert saved["scaler"]["scale"] == summary["final_loss_scale"]
    assert saved["scaler"]["growth_interval"] == 3
    restored = _precision("fp16")
    restored.load_state_dict({"scaler": saved["scaler"]})
    assert restored.loss_scale == summary["final_loss_scale"] != 65536.0


@pytest.mark.parametrize("per_group", [True, False])
def test_several_optimizers_clip_each_by_its_own_norm(per_group):
    """trainer.gradient_clip_per_group (a GAN's two halves): a huge gradient in one group does
    not shrink the other's; all together, both are scaled by the one total norm."""
    big, small = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    big.grad, small.grad = torch.full((3,), 100.0), torch.full((3,), 0.1)
    optimizers = [torch.optim.SGD([big], lr=1.0), torch.optim.SGD([small], lr=1.0)]
    precision = _precision("fp32")
    result = precision.step(optimizers, [big, small], 1.0, clip_per_group=per_group)
    total = torch.cat([torch.full((3,), 100.0), torch.full((3,), 0.1)]).norm()
    assert result.grad_norm.item() == pytest.approx(total.item())  # logged: over all groups
    assert big.grad.norm().item() == pytest.approx(1.0, rel=1e-4)
    expected_small = 0.1 * 3**0.5 if per_group else 0.1 * 3**0.5 / total.item()
    assert small.grad.norm().item() == pytest.approx(expected_small, rel=1e-4)
    precision.close()
