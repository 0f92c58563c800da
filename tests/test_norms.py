"""Norm layers a real model brings (Hugging Face's LlamaRMSNorm, a net's own LayerNorm class) keep
fp32 weights in the modes that cast weights, FSDP gathers them in fp32, and precision truth marks
them as norms; `precision.norm_modules` adds what the rule misses."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from torch import nn

from runner.config import PrecisionConfig
from runner.errors import UserError
from runner.measure.truth import precision_truth
from runner.precision import Precision
from runner.precision.norms import norm_layers
from runner.run import run
from tests.helpers import load_last, make_cfg, module_run
from tests.test_distributed import run_ranks
from tests.test_hf import NEUTRAL, _tokenizer, short_causal_lm

HERE = "tests.test_norms"
CPU = torch.device("cpu")
LOW = {"fp16_master": torch.float16, "bf16_true": torch.bfloat16}


class Affine(nn.Module):
    """A single-file GPT's LayerNorm, under a name that says nothing: an optional bias."""

    def __init__(self, width: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None

    def forward(self, x):
        return nn.functional.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class LayerNorm(Affine):
    """The GPT's own LayerNorm class (its parents: Affine, nn.Module)."""


class Scale(Affine):
    """A norm by another name: the rule cannot tell it from any elementwise layer."""


class OwnNormNet(nn.Module):
    """Two blocks (FSDP's shard units) of a Linear and a norm of class `norm`, and a head."""

    def __init__(self, norm: str = "LayerNorm", width: int = 16, features: int = 8):
        super().__init__()
        kind = globals()[norm]
        self.blocks = nn.Sequential(
            nn.Sequential(nn.Linear(features, width), kind(width)),
            nn.Sequential(nn.Linear(width, width), kind(width, bias=False)),
        )
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.blocks(x))


def net_run(*overrides: str, net: str = "OwnNormNet") -> list[str]:
    return module_run(f"{HERE}.{net}", *overrides)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama (hidden 32, one layer, vocab 64) and a small local corpus."""
    folder = tmp_path_factory.mktemp("llama")
    tiny_llama(folder)
    rng = random.Random(0)
    text = folder / "corpus.txt"
    text.write_text("\n".join(" ".join(rng.choices(NEUTRAL, k=30)) for _ in range(50)))
    return folder, text


def truth_of(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())["precision_truth"]


def assert_norms_fp32(run_dir, mode: str, norm_class: str, norm_names: list[str]) -> None:
    """The checkpoint holds the norms' weights in fp32 and the rest in the mode's dtype; the truth
    table marks the norms' rows as norms, in fp32, with no mismatch."""
    model = load_last(run_dir)["model"]
    norms = {k: v.dtype for k, v in model.items() if k.rpartition(".")[0] in norm_names}
    assert norms and set(norms.values()) == {torch.float32}, norms
    others = {v.dtype for k, v in model.items() if k not in norms and v.is_floating_point()}
    assert others == {LOW[mode]}
    truth = truth_of(run_dir)
    assert truth["mismatches"] == []
    rows = [r for r in truth["rows"] if r["module"] == norm_class]
    assert rows and {(r["norm"], r["weights"]) for r in rows} == {(True, "fp32")}
    assert sum(r["count"] for r in rows) == len(norms)


@pytest.mark.parametrize("mode", ["fp16_master", "bf16_true"])
def test_a_llamas_rmsnorms_stay_fp32(tmp_path, llama, mode):
    folder, text = llama
    cfg = short_causal_lm(folder, text, f"precision={mode}")
    assert run(cfg, tmp_path)["status"] == "completed"
    names = [
        "net.model.norm",
        "net.model.layers.0.input_layernorm",
        "net.model.layers.0.post_attention_layernorm",
    ]
    assert_norms_fp32(tmp_path, mode, "LlamaRMSNorm", names)


@pytest.mark.parametrize("mode", ["fp16_master", "bf16_true"])
def test_a_nets_own_layernorm_class_stays_fp32(tmp_path, mode):
    assert run(make_cfg(*net_run(f"precision={mode}")), tmp_path)["status"] == "completed"
    assert_norms_fp32(tmp_path, mode, "LayerNorm", ["net.blocks.0.1", "net.blocks.1.1"])


def test_norm_modules_adds_a_norm_the_rule_misses(tmp_path):
    """`Scale` is kept fp32 only when named, by class or by a module-name pattern; unnamed, it
    is an ordinary bf16 layer, with no mismatch."""
    norm_names = ["net.blocks.0.1", "net.blocks.1.1"]
    for how, overrides in (
        ("class", ["precision.norm_modules=[Scale]"]),
        ("pattern", ["precision.norm_modules=[net.blocks.*.1]"]),
    ):
        run(
            make_cfg(*net_run("precision=bf16_true", "+model.net.norm=Scale", *overrides)),
            tmp_path / how,
        )
        assert_norms_fp32(tmp_path / how, "bf16_true", "Scale", norm_names)
    run(make_cfg(*net_run("precision=bf16_true", "+model.net.norm=Scale")), tmp_path / "unnamed")
    model = load_last(tmp_path / "unnamed")["model"]
    assert model["net.blocks.0.1.weight"].dtype == torch.bfloat16
    truth = truth_of(tmp_path / "unnamed")
    assert truth["mismatches"] == []
    assert {r["norm"] for r in truth["rows"] if r["module"] == "Scale"} == {False}


def test_a_norm_that_matches_nothing_is_one_clear_line(tmp_path):
    with pytest.raises(UserError, match=r"precision.norm_modules: 'net.ln_\*' matches no module"):
        run(
            make_cfg(*net_run("precision=bf16_true", "precision.norm_modules=[net.ln_*]")), tmp_path
        )
    with pytest.raises(UserError, match=r"precision.norm_modules=\[''\] is invalid"):
        run(make_cfg(*net_run("precision=bf16_true", "precision.norm_modules=['']")), tmp_path)


def test_a_norm_in_low_precision_is_a_mismatch():
    """A norm that bf16_true promised fp32 but that holds bf16 (cast by the net itself after
    the runner prepared it) is named, with the optimizer state that follows it."""
    net = OwnNormNet()
    precision = Precision(OmegaConf.structured(PrecisionConfig(mode="bf16_true")), CPU)
    precision.prepare(net)
    net.blocks[0][1].to(torch.bfloat16)
    optimizer = torch.optim.AdamW(net.parameters())
    net(torch.randn(3, 8)).float().sum().backward()
    optimizer.step()
    truth = precision_truth(net, net, precision, [optimizer])
    assert [m.split(" (e.g.")[0] for m in truth["mismatches"]] == [
        "weights are bf16, but precision=bf16_true holds fp32 weights in norm layers and fp32 "
        "islands: 2 parameter(s) of LayerNorm",
        "optimizer state exp_avg is bf16, not fp32: 2 parameter(s) of LayerNorm",
        "optimizer state exp_avg_sq is bf16, not fp32: 2 parameter(s) of LayerNorm",
    ]
    precision.close()


@pytest.mark.slow  # starts two ranks: make test runs one process a test (make test-slow, CI)
def test_fsdp_gathers_a_nets_own_layernorm_in_fp32(tmp_path):
    """FSDP bf16: the blocks' Linears gathered in bf16, the norms inside them in fp32 units."""
    run_ranks([(net_run("precision=bf16", "trainer.strategy=fsdp"), tmp_path)])
    truth = truth_of(tmp_path)
    assert truth["mismatches"] == []
    gathers = {}
    for row in truth["rows"]:
        gathers.setdefault((row["module"], row["example"].startswith("net.blocks.")), set())
        gathers[row["module"], row["example"].startswith("net.blocks.")].add(row["gather"])
    assert gathers == {
        ("Linear", True): {"bf16"},
        ("LayerNorm", True): {"fp32"},
        ("Linear", False): {"fp32"},
    }


def test_the_rule_reads_what_a_module_holds():
    """Norms by torch class, or by a class name with "norm" and only 1-D parameters; not a
    Linear called a norm, a parameterless one, or a container of norms."""

    class LinearNorm(nn.Linear):
        pass

    class FlatNorm(nn.Module):
        def forward(self, x):
            return x / x.norm()

    model = nn.Sequential(
        nn.BatchNorm1d(4), LayerNorm(4), LinearNorm(4, 4), FlatNorm(), nn.Sequential(LayerNorm(4))
    )
    model[4].weight = nn.Parameter(torch.ones(4))  # a container with a 1-D parameter of its own
    assert norm_layers(model) == {model[0], model[1], model[4][0]}
    assert norm_layers(model, ["Line*"]) == {model[0], model[1], model[2], model[4][0]}


def tiny_llama(folder) -> None:
    """A tiny Llama (hidden 32, one layer, vocab 64) and its tokenizer, saved with
    save_pretrained (the docs tests' supply makes the docs' Llama with it too)."""
    _tokenizer(folder)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
