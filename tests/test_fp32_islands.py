"""fp32 islands: `precision.fp32_modules` and a custom op that only supports fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runner.config import PrecisionConfig
from runner.errors import UserError
from runner.precision import Precision
from runner.run import build, run
from tasks.ops import fp32_softplus
from tests.helpers import TINY_BERT, TINY_MLP, make_cfg


def _output_dtypes(task, precision, batch) -> dict[str, torch.dtype]:
    seen = {}

    def record(name):
        def hook(module, args, out):
            seen[name] = out.dtype  # returns None: the output is left alone

        return hook

    for name in ("net.0", "net.3"):
        dict(task.named_modules())[name].register_forward_hook(record(name))
    with precision.autocast():
        task(batch)
    return seen


@pytest.mark.parametrize("mode, low", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_named_modules_run_in_fp32_and_the_rest_stays_autocast(mode, low):
    data, task = build(make_cfg(*TINY_MLP))
    batch = next(iter(data.train_loader()))
    precision = Precision(PrecisionConfig(mode=mode), torch.device("cpu"))
    try:
        assert _output_dtypes(task, precision, batch) == {"net.0": low, "net.3": low}
        data, task = build(make_cfg(*TINY_MLP))
        precision.prepare(task, ["net.0"])
        assert _output_dtypes(task, precision, batch) == {"net.0": torch.float32, "net.3": low}
        with precision.autocast():
            task(batch)
            assert torch.is_autocast_enabled("cpu")  # the island closed behind itself
    finally:
        precision.close()


def test_an_fnmatch_pattern_makes_every_module_it_matches_an_island():
    """`*` spans dots, as in precision.norm_modules: the pattern matches both layers' FFN output
    and attention output projections. Read off the forward itself: their outputs are fp32 under
    bf16 autocast, the other Linears' bf16."""
    data, task = build(make_cfg(*TINY_BERT, "model.num_hidden_layers=2"))
    batch = next(iter(data.train_loader()))
    precision = Precision(PrecisionConfig(mode="bf16"), torch.device("cpu"))
    seen = {}
    for name, module in task.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(
                lambda m, a, out, name=name: seen.update({name: out.dtype})
            )
    try:
        precision.prepare(task, ["*.encoder.layer.*.output.dense"])
        with precision.autocast():
            task(batch)
    finally:
        precision.close()
    fp32 = {n for n, dtype in seen.items() if dtype == torch.float32}
    assert fp32 == {
        f"model.bert.encoder.layer.{i}.{part}output.dense"
        for i in (0, 1)
        for part in ("", "attention.")
    }
    assert len(seen) > len(fp32) and all(
        d == torch.bfloat16 for n, d in seen.items() if n not in fp32
    )


@pytest.mark.parametrize("pattern", ["net.9", "net.*.dense"])
def test_a_name_or_pattern_that_matches_no_module_is_one_clear_error(tmp_path, pattern):
    overrides = ["precision=bf16", f"precision.fp32_modules=[{pattern}]"]
    with pytest.raises(UserError) as e:
        run(make_cfg(*TINY_MLP, *overrides), tmp_path)
    assert str(e.value).startswith(f"precision.fp32_modules: '{pattern}' matches no module")
    assert "net.0" in str(e.value) and "\n" not in str(e.value)


def test_runs_with_islands_train(tmp_path):
    cfg = make_cfg(
        *TINY_MLP, "precision=bf16", "precision.fp32_modules=[net.0,net.3]", "trainer.max_steps=5"
    )
    assert run(cfg, tmp_path)["status"] == "completed"


def test_a_fp32_only_op_refuses_low_precision_but_runs_under_autocast(tmp_path):
    x = torch.randn(16, requires_grad=True)
    with pytest.raises(TypeError, match="float32 only"):
        fp32_softplus(x.detach().bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp32_softplus(x.bfloat16())
    assert y.dtype == torch.float32
    y.sum().backward()
    torch.testing.assert_close(
        x.grad, torch.sigmoid(x.detach()), rtol=1e-2, atol=1e-2
    )  # x went via bf16
    torch.testing.assert_close(y, F.softplus(x.detach()), rtol=1e-2, atol=1e-2)
    for mode in ("bf16", "fp16"):
        cfg = make_cfg(
            *TINY_MLP, f"precision={mode}", "model.activation=fp32_softplus", "trainer.max_steps=5"
        )
        summary = run(cfg, tmp_path / mode)
        assert summary["status"] == "completed" and summary["skipped_steps"] == 0
