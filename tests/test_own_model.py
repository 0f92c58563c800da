"""`model=module` and `dataset=torch`: a user's own net and data, by `_target_`, no subclassing;
the examples/ package run from outside the repository."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import datasets
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from runner.errors import UserError
from runner.run import build, run, seed_everything
from tests.helpers import cli, make_cfg, read_metrics

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
HERE = "tests.test_own_model"
QUIET = ["trainer.progress_bar=false", "logger=none"]


# -- what a user's package holds: nets and datasets reached by _target_ ------------------------


class Net(nn.Module):
    """Two blocks and a head; `forward(x)`."""

    def __init__(self, width: int = 16, features: int = 8, outputs: int = 3):
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Sequential(nn.Linear(features, width), nn.GELU()),
            nn.Sequential(nn.Linear(width, width), nn.GELU()),
        )
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        return self.head(self.blocks(x))


class KeywordNet(Net):
    """Takes dict items by name, as `forward(x, scale)`."""

    def forward(self, x, scale):
        return super().forward(x * scale.unsqueeze(1))


class LossNet(Net):
    """Returns its own loss, the mean over the micro-batch (`model.loss=output`)."""

    def forward(self, x, target):
        return nn.functional.cross_entropy(super().forward(x), target)


class MiddleLossNet(Net):
    """`model.loss=output` with the loss inside a tuple, neither first nor last."""

    def forward(self, x, target):
        logits = super().forward(x)
        return logits, nn.functional.cross_entropy(logits, target), logits.detach()


class NoLossNet(Net):
    """A tuple without a scalar tensor."""

    def forward(self, x, target):
        logits = super().forward(x)
        return logits, logits.detach()


class TwoLossNet(Net):
    """A tuple with two scalar tensors: which is the loss is anyone's guess."""

    def forward(self, x, target):
        logits = super().forward(x)
        loss = nn.functional.cross_entropy(logits, target)
        return logits, loss, loss.detach() * 0.1


CONTEXT, VOCAB = 8, 32  # the tiny GPT's sequence length and vocabulary


class Block(nn.Module):
    """Pre-norm causal self-attention (one head) and an MLP."""

    def __init__(self, width: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """A single-file GPT as they ship: `forward(idx, targets=None)` returns `(logits, loss)`, the
    loss the mean cross-entropy over every position, None without targets."""

    def __init__(self, width: int = 16, layers: int = 2):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, width), nn.Embedding(CONTEXT, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, VOCAB)

    def forward(self, idx, targets=None):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits, None
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def token_pairs(n: int = 256, seed: int = 0) -> Dataset:
    """(ids, the ids shifted by one) of CONTEXT tokens that count up modulo VOCAB, as a GPT's
    data loader yields them."""
    start = torch.randint(VOCAB, (n, 1), generator=torch.Generator().manual_seed(seed))
    ids = (start + torch.arange(CONTEXT + 1)) % VOCAB
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def pairs(n: int = 256, seed: int = 0, regression: bool = False) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x, y.float().unsqueeze(1).expand(n, 3) if regression else y)


def hf_table(n: int = 256) -> datasets.Dataset:
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
    return datasets.Dataset.from_dict(
        {"x": x.numpy(), "scale": [2.0] * n, "labels": (x[:, 0] > 0).long().numpy()}
    )


def module_cfg(*overrides: str, net: str = "Net", data: str = "pairs"):
    return make_cfg(
        "model=module",
        f"model.net._target_={HERE}.{net}",
        f"dataset.train._target_={HERE}.{data}",
        "dataset.batch_size=16",
        *QUIET,
        *overrides,
    )


def test_the_issue_command_line_trains_a_net_and_evaluates_it(tmp_path):
    """The documented form: the net's arguments with +model.net.KEY, a validation set, and the
    metrics a classifier gets (accuracy, macro-F1)."""
    cfg = module_cfg(
        "+model.net.width=32",
        "model.loss=cross_entropy",
        f"dataset.validation._target_={HERE}.pairs",
        "+dataset.validation.seed=1",
        "trainer.max_steps=40",
        "trainer.val_check_interval=40",
        "optim.optimizer.lr=0.01",
    )
    summary = run(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["task"] == "ModuleTask"
    assert summary["parameters"] == sum(p.numel() for p in Net(32).parameters())
    rows = read_metrics(tmp_path)
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    assert summary["eval_accuracy"] > 0.6 and 0 < summary["eval_macro_f1"] <= 1


def test_dict_items_go_to_the_net_by_name_from_a_hf_dataset(tmp_path):
    summary = run(module_cfg("trainer.max_steps=3", net="KeywordNet", data="hf_table"), tmp_path)
    assert summary["status"] == "completed"


@pytest.mark.parametrize(
    "loss, net, data",
    [
        ("mse", "Net", "pairs"),
        ("output", "LossNet", "pairs"),
        ("{_target_:torch.nn.SmoothL1Loss,beta:0.5}", "Net", "pairs"),
    ],
)
def test_every_kind_of_loss_trains(tmp_path, loss, net, data):
    extra = ["+dataset.train.regression=true"] if loss != "output" else []
    summary = run(
        module_cfg(f"model.loss={loss}", "trainer.max_steps=3", *extra, net=net), tmp_path
    )
    assert summary["status"] == "completed" and math.isfinite(summary["final_loss"])


@pytest.mark.parametrize(
    "loss, extra, exact",
    [
        ("cross_entropy", [], True),
        ("mse", ["+dataset.train.regression=true"], True),
        (
            "{_target_:torch.nn.functional.l1_loss,reduction:none}",
            ["+dataset.train.regression=true"],
            True,
        ),
        ("output", [], False),  # a mean per micro-batch: not target-normalised
    ],
)
def test_accumulation_is_target_normalised_where_the_loss_allows(loss, extra, exact):
    """The window's loss over 2 micro-batches of 3 and 5 samples equals the loss over the 8
    together for summable losses; the net's own mean loss is averaged per micro-batch."""
    net = "LossNet" if loss == "output" else "Net"
    data, task = build(module_cfg(f"model.loss={loss}", *extra, net=net))
    keys = [(0, 0, i) for i in range(8)]
    whole = data.collate("train", keys)
    parts = [data.collate("train", keys[:3]), data.collate("train", keys[3:])]
    together = task(whole) / task.num_targets(whole)
    window = sum(task(p) for p in parts) / sum(task.num_targets(p) for p in parts)
    assert (torch.allclose(window, together, rtol=1e-5)) == exact


def test_freeze_keeps_named_parameters_fixed(tmp_path):
    cfg = module_cfg("model.freeze=[blocks.0]", "trainer.max_steps=3")
    summary = run(cfg, tmp_path)
    seed_everything(cfg.seed)
    _, task = build(cfg)  # the initial weights again
    final = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["model"]
    start = task.state_dict()
    assert torch.equal(final["net.blocks.0.0.weight"], start["net.blocks.0.0.weight"])
    assert not torch.equal(final["net.blocks.1.0.weight"], start["net.blocks.1.0.weight"])
    assert summary["frozen"] == ["blocks.0"]
    assert summary["trainable_parameters"] == summary["parameters"] - 8 * 16 - 16


def _saved_bytes_and_grads(task, batch, precision: str):
    """Backward under the mode's autocast: the bytes saved for backward and the gradients."""
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t

    task.zero_grad()
    torch.manual_seed(0)  # the same dropout masks for both
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=dtype):
            loss = task(batch)
        loss.backward()
    return sum(saved), {n: p.grad.clone() for n, p in task.named_parameters()}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gradient_checkpointing_recomputes_in_the_forwards_precision(precision):
    """Checkpointed blocks save less for backward, and their recomputation runs under the same
    autocast as the forward did: the gradients are those of the plain model, bit for bit."""
    plain_data, plain = build(module_cfg())
    _, checkpointed = build(module_cfg("model.gradient_checkpointing=true"))
    checkpointed.load_state_dict(plain.state_dict())
    batch = plain_data.collate("train", [(0, 0, i) for i in range(16)])
    assert_recomputed_alike(plain, checkpointed, batch, precision)


def assert_recomputed_alike(plain, checkpointed, batch, precision: str) -> None:
    """The checkpointed task saves less for backward, and its gradients are the plain one's."""
    plain_bytes, plain_grads = _saved_bytes_and_grads(plain, batch, precision)
    ckpt_bytes, ckpt_grads = _saved_bytes_and_grads(checkpointed, batch, precision)
    assert ckpt_bytes < plain_bytes
    for name, grad in plain_grads.items():
        assert torch.equal(ckpt_grads[name], grad), name


def test_a_torch_dataset_resumes_exactly(tmp_path):
    """The runner's sample stream serves the user's data: stopped at step 4 and resumed, a run
    ends where an uninterrupted one does."""
    whole = run(module_cfg("trainer.max_steps=8", "optim.optimizer.fused=false"), tmp_path / "a")
    run(module_cfg("trainer.max_steps=4", "optim.optimizer.fused=false"), tmp_path / "b")
    resumed = run(
        module_cfg("trainer.max_steps=8", "optim.optimizer.fused=false", "trainer.resume=auto"),
        tmp_path / "b",
    )
    assert resumed["final_loss"] == whole["final_loss"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.net._target_=mypkg.nowhere.Net"], "cannot build model.net (mypkg.nowhere.Net)"),
        (["dataset.train._target_=tests.test_own_model.nothing"], "cannot build dataset.train"),
        (
            ["+dataset.train.regression=true"],
            "model.loss=cross_entropy needs integer class targets",
        ),
        (["model.loss=mse"], "model.loss=mse needs floating-point targets"),
        (
            ["model.loss=hinge"],
            "model.loss='hinge' is invalid: allowed: cross_entropy, mse, output",
        ),
        (["model.freeze=[trunk]"], "model.freeze: 'trunk' names no parameter of the net"),
        (["+model.net.outputs=4", "+dataset.train.regression=true", "model.loss=mse"], None),
        (["dataset.train._target_=builtins.object"], "expected a map-style"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, overrides, message):
    cfg = module_cfg("trainer.max_steps=1", *overrides)
    with pytest.raises(UserError) as error:
        run(cfg, tmp_path)
    text = str(error.value)
    assert "\n" not in text
    if message:
        assert message in text
    else:  # wrong output shape for the targets, found by the build's probe of 64 items
        assert "does not match targets of shape [64, 3]" in text, text


def test_the_example_package_sweeps_from_outside_the_repository(tmp_path):
    """examples/: a user's package with a net, a dataset and its own config option, found by
    hydra.searchpath; run where the repository is not the working directory, as a sweep, and
    compared."""
    shutil.copytree(EXAMPLES, tmp_path / "project")
    env = os.environ | {"PYTHONPATH": str(tmp_path / "project")}
    sweep = tmp_path / "sweep"
    proc = cli(
        "-m",
        "precision=fp32,bf16,fp16",
        "hydra.searchpath=[pkg://mypkg.conf]",
        "model=stripes",
        "trainer.max_steps=6",
        "trainer.val_check_interval=6",
        "trainer.limit_val_batches=1",
        *QUIET,
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((sweep / "compare.json").read_text())
    assert [r["precision"] for r in rows] == ["fp32", "bf16", "fp16"]
    assert all(r["status"] == "completed" for r in rows), rows


# -- models as they ship: a single-file GPT's (logits, loss), counted in tokens -----------------


def test_a_single_file_gpt_trains_on_the_loss_in_its_tuple_and_counts_tokens(tmp_path):
    """The GPT's own loss, the scalar in its `(logits, loss)`, is the loss the runner computes
    from its logits (the same first step from the same weights); its speed is in tokens, the
    sequence length times its samples."""
    gpt = [f"model.net._target_={HERE}.TinyGPT", f"dataset.train._target_={HERE}.token_pairs"]
    steps = ["trainer.max_steps=3", "trainer.log_every_n_steps=1", "trainer.val_check_interval=0"]
    own = run(module_cfg(*gpt, *steps, "model.loss=output"), tmp_path / "own")
    computed = run(module_cfg(*gpt, *steps, "model.loss=cross_entropy"), tmp_path / "ce")
    assert own["status"] == computed["status"] == "completed"
    first = [read_metrics(tmp_path / d)[0]["loss"] for d in ("own", "ce")]
    assert first[0] == pytest.approx(first[1], rel=1e-5)
    for row in read_metrics(tmp_path / "own"):
        assert row["tokens_per_s"] == pytest.approx(CONTEXT * row["samples_per_s"])


def test_a_loss_neither_first_nor_last_in_the_tuple_is_named_once(tmp_path, capsys):
    steps = ["trainer.max_steps=2", "trainer.val_check_interval=0"]
    run(module_cfg("model.loss=output", *steps, net="MiddleLossNet"), tmp_path / "middle")
    said = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert said.count("its loss is element 1, its one scalar tensor") == 1
    run(module_cfg("model.loss=output", *steps, net="LossNet"), tmp_path / "alone")
    middle, alone = (read_metrics(tmp_path / d)[0]["loss"] for d in ("middle", "alone"))
    assert middle == pytest.approx(alone, rel=1e-6)  # the element it took is the loss


@pytest.mark.parametrize(
    "net, message",
    [("NoLossNet", "holds none"), ("TwoLossNet", "holds 2 (elements 1, 2)")],
)
def test_a_tuple_without_one_scalar_is_one_clear_line(tmp_path, net, message):
    with pytest.raises(UserError) as error:
        run(module_cfg("model.loss=output", "trainer.max_steps=1", net=net), tmp_path)
    text = str(error.value)
    assert "\n" not in text and "the net returned a tuple of" in text and message in text, text
