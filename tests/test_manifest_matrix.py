"""The combination matrix of issue 29 §3, checked by the precision manifest: precision modes ×
features × models, pairwise (every (mode, feature), (mode, model) and (feature, model) pair in at
least one cell), generated here by a small greedy all-pairs search. Every cell runs a tiny model
for two steps and holds the manifest's invariants (the plan held, no mismatch, every op in a
known format, islands fp32 in every direction, the Linears fp8, mxfp8, nvfp4 and mxfp4 convert
computing in their format and the skipped ones not, frozen parameters unchanged and without
optimizer state), plus one fact per feature read from outside the runner's own report (the
checkpoint, metrics.jsonl, a forward hook, the exported adapters loaded by peft). A combination
the runner refuses by design is a cell too: it asserts the refusal is one clear line."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import re
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from runner.errors import UserError
from runner.export import export
from runner.precision import Precision
from runner.precision.fp4 import Fp4Linear
from runner.run import run
from tests.helpers import load_last, make_cfg, read_metrics
from tests.test_distributed import PATIENCE_S, WORLD, run_ranks
from tests.test_hf import NEUTRAL, POSITIVE, _tokenizer

HERE = "tests.test_manifest_matrix"
MODES = ["fp32", "bf16", "fp16", "fp16_master", "bf16_true", "fp8", "mxfp8", "nvfp4", "mxfp4"]
MODES.append("staged")
FEATURES = [
    "none",
    "freeze",
    "lora",
    "islands",
    "auto_islands",
    "fp32_head",
    "keep_bf16",
    "eval_precisions",
    "resume",
    "resume_other",
    "export",
    "checkpointing",
    "compile",
    "ddp",
    "fsdp",
    "recipe",
]
MODELS = ["net", "gpt2", "llama", "bert"]  # the user's net first: the cheapest wins ties
RANKS = ("ddp", "fsdp")
FP8 = ("fp8", "mxfp8")
FP4 = ("nvfp4", "mxfp4")
CONVERTING = FP8 + FP4  # the modes that swap Linears: torchao's (fp8) or the runner's Fp4Linear
STAGES = "precision.stages=[{mode:fp32,until_step:1},{mode:bf16}]"
# resume_other: the mode a checkpoint of the cell's mode is resumed in (each weight layout and
# dtype a mode holds is read by another: bf16_true's and fp16_master's casts, fp8's Linears)
PARTNER = {
    "fp32": "bf16_true",
    "bf16": "fp8",
    "fp16": "fp16_master",
    "fp16_master": "bf16",
    "bf16_true": "fp32",
    "fp8": "fp16_master",
    "mxfp8": "bf16_true",
    "nvfp4": "fp16_master",
    "mxfp4": "fp8",
    "staged": "fp16",
}
WEIGHTS = {"fp16_master": torch.float16, "bf16_true": torch.bfloat16}  # else fp32
KNOWN_FORMATS = {"fp32", "tf32", "bf16", "fp16", *CONVERTING}
OPERAND = re.compile(
    r"(fp32|fp64|bf16|fp16|fp8 e(4m3|5m2)( \w+)?|mxfp8 e(4m3|5m2) block \d+"
    r"|(nv|mx)fp4 e2m1 (block \d+|tile \d+×\d+))$"
)
# Cells the generator must hold: the combinations issue 29 §4 found broken, and an fp16 island
# search on the net with an overflowing layer (elsewhere a healthy model needs no island).
REQUIRED = [
    ("fp8", "lora", "gpt2"),
    ("mxfp8", "freeze", "gpt2"),
    ("fp8", "islands", "gpt2"),
    ("fp8", "resume_other", "gpt2"),
    ("bf16_true", "eval_precisions", "llama"),
    ("fp8", "eval_precisions", "net"),
    ("fp16", "auto_islands", "net"),
    ("nvfp4", "lora", "gpt2"),  # Conv1D → Fp4Linear under LoRA: the fp8 defect's class
    ("mxfp4", "resume_other", "gpt2"),
    # a recipe under each converting mode, on each model (GPT-2's Conv1D, Llama's RMSNorm)
    ("fp8", "recipe", "bert"),
    ("mxfp8", "recipe", "llama"),
    ("nvfp4", "recipe", "gpt2"),
    ("mxfp4", "recipe", "net"),
]


def all_pairs(factors: list[list[str]], required: list[tuple] = ()) -> list[tuple[str, ...]]:
    """A covering array of strength 2: the `required` cells, then greedily the candidate (in
    product order, the first on a tie) that covers the most pairs not yet covered."""

    def pairs(cell: tuple) -> set[tuple]:
        return {(i, cell[i], j, cell[j]) for i, j in itertools.combinations(range(len(cell)), 2)}

    candidates = list(itertools.product(*factors))
    uncovered = set().union(*map(pairs, candidates))
    cells: list[tuple] = []
    for cell in [*required, None]:
        while cell is None and uncovered:
            best = max(candidates, key=lambda c: len(pairs(c) & uncovered))
            cells.append(best)
            uncovered -= pairs(best)
        if cell is not None:
            cells.append(cell)
            uncovered -= pairs(cell)
    return cells


# precision.autopilot (issue 48), after the covering array (it is left as it was): a cell per
# converting mode, each on another model (GPT-2's Conv1D, Llama's RMSNorm), with a floor no unit
# meets so that every unit moves at the first measured step; and its refusal outside them
AUTOPILOT = [
    ("fp8", "autopilot", "gpt2"),
    ("mxfp8", "autopilot", "llama"),
    ("nvfp4", "autopilot", "bert"),
    ("mxfp4", "autopilot", "net"),
    ("staged", "autopilot", "net"),
]
CELLS = all_pairs([MODES, FEATURES, MODELS], REQUIRED) + AUTOPILOT


def refusal(mode: str, feature: str) -> str | None:
    """The line (a regular expression) a cell the runner refuses by design fails with."""
    if feature == "fsdp" and mode in ("fp16_master", "bf16_true"):
        return rf"precision.mode='{mode}' is invalid: with trainer.strategy=fsdp use precision="
    if feature == "auto_islands" and mode == "fp32":
        return "the fp32 islands search needs a low-precision mode: precision=fp32 computes in fp32"
    if feature == "autopilot" and mode not in CONVERTING:
        return rf"precision.autopilot.enabled=true is invalid with precision={mode}: the autopilot"
    if feature == "recipe" and mode not in CONVERTING:
        return (
            r"precision.recipe=.* is invalid: a recipe chooses formats per Linear in a converting"
        )
    return None


def cell_id(cell: tuple) -> str:
    return "-".join(cell)


def marks(cell: tuple) -> list:
    # two ranks: a slow test (make test runs one process a test; make test-slow and CI run them)
    return [pytest.mark.xdist_group("ranks"), pytest.mark.slow] if cell in DISTRIBUTED else []


# --- the models ---------------------------------------------------------------------------


class OwnRMSNorm(nn.Module):
    """The user's own norm class: not torch's, found by its name."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
        return normed.to(x.dtype) * self.weight


class Loud(nn.Linear):
    """A Linear whose output is × 1e5: past fp16's 65504 (the island search's culprit)."""

    def forward(self, x):
        return super().forward(x) * 1e5


class Net(nn.Module):
    """A user's net: four blocks (FSDP's units) of a Linear (32-wide: mxfp8's and mxfp4's
    multiple) and its own norm, and a head. The first Linear and the head are fp8's first and
    last (skipped); blocks.1.0 to blocks.3.0 convert (fp4 keeps the last block in bf16, so an
    island on blocks.1 still leaves blocks.2.0 to convert). `loud`: blocks.1.0 overflows fp16."""

    def __init__(self, width: int = 32, features: int = 8, outputs: int = 3, loud: bool = False):
        super().__init__()
        self.blocks = nn.Sequential(
            *(
                nn.Sequential(
                    (Loud if loud and i == 1 else nn.Linear)(features if i == 0 else width, width),
                    OwnRMSNorm(width),
                )
                for i in range(4)
            )
        )
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        return self.head(self.blocks(x))


def net_data(n: int = 256, seed: int = 0):
    from tests.test_own_model import pairs

    return pairs(n, seed)


TINY = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Tiny two-layer HF models (BERT classifier, GPT-2, Llama) saved with save_pretrained, a
    corpus and a review table: made once per module (per xdist worker)."""
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    out = {}
    for name in ("bert", "gpt2", "llama"):
        folder = out[name] = root / name
        vocab = len(_tokenizer(folder))
        if name == "bert":
            config = transformers.BertConfig(
                vocab_size=vocab, num_labels=2, num_hidden_layers=2, **TINY
            )
            transformers.BertForSequenceClassification(config).save_pretrained(folder)
        elif name == "gpt2":
            config = transformers.GPT2Config(
                vocab_size=vocab, n_embd=32, n_layer=2, n_head=2, n_positions=64
            )
            transformers.GPT2LMHeadModel(config).save_pretrained(folder)
        else:
            config = transformers.LlamaConfig(
                vocab_size=vocab, num_hidden_layers=2, num_key_value_heads=2, **TINY
            )
            transformers.LlamaForCausalLM(config).save_pretrained(folder)
    rng = random.Random(0)
    out["corpus"] = root / "corpus.txt"
    out["corpus"].write_text("\n".join(" ".join(rng.choices(NEUTRAL, k=30)) for _ in range(40)))
    for split, n in (("train", 64), ("validation", 16)):
        rows = ["review,sentiment"]
        for _ in range(n):
            words = rng.choices(NEUTRAL, k=6) + [rng.choice(POSITIVE + ["bad", "poor"])]
            rows.append(f"{' '.join(words)},{'pos' if words[-1] in POSITIVE else 'neg'}")
        (root / f"{split}.csv").write_text("\n".join(rows) + "\n")
    out["reviews"] = root
    return out


QUIET = ["trainer.progress_bar=false", "logger=none", "trainer.log_every_n_steps=1"]
# name: (freeze prefix, LoRA targets, explicit island, output head, a big Linear)
SPECS = {
    "net": ("blocks.1", "[blocks.1.0,blocks.2.0]", "net.blocks.1", "net.head", "net.blocks.1.0"),
    "gpt2": (
        "transformer.h.0.attn",
        "[c_attn]",
        "net.transformer.h.0.mlp",
        "net.lm_head",
        "net.transformer.h.0.mlp.c_fc",
    ),
    "llama": (
        "model.layers.0.self_attn",
        "[q_proj,v_proj]",
        "net.model.layers.0.mlp",
        "net.lm_head",
        "net.model.layers.0.mlp.up_proj",
    ),
    "bert": (
        "bert.encoder.layer.0.attention",
        "[query,value]",
        "net.bert.encoder.layer.0.output",
        "net.classifier",
        "net.bert.encoder.layer.0.intermediate.dense",
    ),
}


def model_overrides(model: str, folders: dict[str, Path], evaluate: bool = False) -> list[str]:
    """A tiny two-step run of `model`, evaluation off unless `evaluate`."""
    steps = ["trainer.max_steps=2", "trainer.val_check_interval=0", *QUIET]
    steps.append(f"trainer.limit_val_batches={2 if evaluate else 0}")
    if model == "net":
        out = [
            "model=module",
            f"model.net._target_={HERE}.Net",
            f"dataset.train._target_={HERE}.net_data",
            "dataset.batch_size=32",
        ]
        if evaluate:
            out += [f"dataset.validation._target_={HERE}.net_data", "+dataset.validation.seed=1"]
        return out + steps
    common = [
        "model=hf",
        f"model.name_or_path={folders[model]}",
        "dataset.seq_len=16",
        "dataset.batch_size=4",
    ]
    if model == "bert":
        reviews = folders["reviews"]
        return [
            *common,
            f"dataset.data_files={reviews / 'train.csv'}",
            f"dataset.validation_files={reviews / 'validation.csv'}",
            "dataset.text_column=review",
            "dataset.label_column=sentiment",
            *steps,
        ]
    return [
        *common,
        "model.task=causal_lm",
        "model.loss=output",
        "dataset=text_files",
        f"dataset.data_files={folders['corpus']}",
        *steps,
    ]


def mode_overrides(mode: str) -> list[str]:
    out = [f"precision={mode}"]
    if mode == "staged":
        out.append(STAGES)
    return out


def lora(model: str) -> list[str]:
    # r=16: a multiple of 16, where fp8 once converted the adapters themselves (issue 29 §4)
    return [f"model.peft={{r:16,alpha:16,target_modules:{SPECS[model][1]}}}"]


# keep_bf16, by mode: the override and the reason it gives the kept Linears. FP4's default already
# keeps the last block (the paper's recipe), so its cells keep the first instead; outside the
# converting modes fp8's key is accepted and changes nothing.
KEEP_BF16 = {
    "fp8": ("precision.fp8.keep_bf16.last=1", "keep_bf16.last=1"),
    "fp4": ("precision.fp4.keep_bf16={first:1,last:0}", "keep_bf16.first=1"),
}


def keep_bf16(mode: str) -> tuple[str, str]:
    return KEEP_BF16["fp4" if mode in FP4 else "fp8"]


def feature_overrides(feature: str, model: str, mode: str, folders) -> list[str]:
    freeze, _, island, _, _ = SPECS[model]
    if feature == "recipe":
        return [f"precision.recipe={recipe_file(folders, model, mode)}"]
    return {
        "none": [],
        "freeze": [f"model.freeze=[{freeze}]"],
        "lora": lora(model),
        "export": lora(model),
        "islands": [f"precision.fp32_modules=[{island}]"],
        "auto_islands": [
            "precision.fp32_modules=auto",
            "runner.islands_steps=2",
            "runner.islands_max=2",
            *(["+model.net.loud=true"] if model == "net" else []),
        ],
        "fp32_head": ["precision.fp32_head=true"],
        "autopilot": [
            "precision.autopilot.enabled=true",
            "precision.autopilot.every_n_steps=1",
            *([f"precision.autopilot.sqnr_floor_db.{mode}=1000"] if mode in CONVERTING else []),
        ],
        "keep_bf16": [keep_bf16(mode)[0]],
        "eval_precisions": ["runner.eval_precisions=[bf16]"],
        "checkpointing": ["model.gradient_checkpointing=true"],
        "compile": ["trainer.compile=true"],
        "ddp": ["trainer.strategy=ddp", "trainer.device=cpu"],
        "fsdp": ["trainer.strategy=fsdp", "trainer.device=cpu"],
    }.get(feature, [])


# recipe: the direction each converting mode's rule keeps in bf16 on one Linear every converting
# mode converts (mxfp8 switches weight_grad alone): the model's big Linear (SPECS' last), Llama's
# up_proj among them, whose input gradient at 64 tokens (64 × 32) has the weight's shape
RECIPE = {"fp8": "input_grad", "mxfp8": "weight_grad", "nvfp4": "weight_grad", "mxfp4": "forward"}


def recipe_file(folders, model: str, mode: str) -> Path:
    """A one-rule recipe keeping RECIPE[mode] of the model's big Linear in bf16 (a converting
    mode's; the others refuse any recipe), written beside the models."""
    direction = RECIPE.get(mode, "weight_grad")
    path = folders["reviews"] / f"recipe-{model}-{mode}.yaml"
    path.write_text(f"- {{module: {SPECS[model][4]}, {direction}: bf16}}\n")
    return path


def overrides(cell: tuple, folders, mode: str | None = None) -> list[str]:
    cell_mode, feature, model = cell
    return [
        *model_overrides(model, folders, evaluate=feature == "eval_precisions"),
        *mode_overrides(mode or cell_mode),
        *feature_overrides(feature, model, mode or cell_mode, folders),
    ]


# --- watching a run from outside ------------------------------------------------------------


class Watch:
    """Installed on Precision.prepare: the task (after its preparation), its state before it,
    and the output dtypes of the modules named in `hooked` (forward hooks, every pass)."""

    def __init__(self, monkeypatch, hooked: list[str] = ()):
        self.task: nn.Module | None = None
        self.initial: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, set[torch.dtype]] = defaultdict(set)
        self.hooked = list(hooked)
        prepare = Precision.prepare

        def watched(precision, task, fp32_modules, *args, **kwargs):
            self.initial = {k: v.detach().clone() for k, v in task.state_dict().items()}
            prepare(precision, task, fp32_modules, *args, **kwargs)
            self.task = task
            names = self.hooked or ([] if fp32_modules == "auto" else list(fp32_modules))
            modules = dict(task.named_modules())
            for name in names:
                modules[name].register_forward_hook(self._record(name))

        monkeypatch.setattr(Precision, "prepare", watched)

    def _record(self, name: str):
        def hook(_module, _args, output):
            flat = torch.utils._pytree.tree_flatten(output)[0]
            self.outputs[name] |= {
                t.dtype for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()
            }

        return hook


def ops(summary: dict) -> list[dict]:
    """Every op of every audited stage, with its module's name and class."""
    return [
        o | {"module": name, "class": entry["class"], "stage": stage["mode"]}
        for stage in summary["precision_manifest"]["stages"]
        for name, entry in stage["modules"].items()
        for o in entry["ops"]
    ]


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(f"{prefix}.")


def assert_manifest(summary: dict, islands: list[str] = ()) -> None:
    """The manifest's invariants, for a run in summary['precision'] (its last stage's mode)."""
    assert summary["status"] == "completed", summary.get("error")
    manifest = summary["precision_manifest"]
    assert manifest["mismatches"] == [] and summary["plan_held"] is True, manifest["mismatches"]
    seen = ops(summary)
    assert seen, "the manifest recorded no op"
    for o in seen:
        assert o["format"] in KNOWN_FORMATS, o
        assert all(OPERAND.match(f) for f in o["inputs"]), o
    for island in islands:
        mine = [o for o in seen if under(o["module"], island)]
        assert mine, f"the island {island} ran no recorded op"
        assert {(o["format"], tuple(o["inputs"])) for o in mine} == {("fp32", ("fp32",))}, mine
        assert {"forward", "weight_grad"} <= {o["direction"] for o in mine}, mine
    if summary["precision"] in CONVERTING:
        converted = summary["converted"]  # every converting mode's Linears: the same rules
        assert converted["converted"], converted  # every model here has an aligned Linear
        low = {o["module"] for o in seen if o["format"] == summary["precision"]}
        assert low, f"a converted Linear, but no op ran in {summary['precision']}"
        assert low <= set(converted["converted"]), low - set(converted["converted"])
        for skipped in converted["skipped"]:
            why = converted["skipped"][skipped]
            assert skipped not in low, f"{skipped} is skipped ({why}) yet ran converted"
    for name, p in manifest["parameters"].items():
        if not p["trainable"]:
            assert p["changed"] is False and not p["optimizer_state"], (name, p)
    assert_errors_match(summary, seen)


def assert_errors_match(summary: dict, seen: list[dict]) -> None:
    """Each matmul's measured error (on by default) is of what the dispatcher saw: every record
    of an audited step names a module, direction and format the manifest has, and every Linear
    the manifest saw compute a forward has its forward measured."""
    audited = {stage["step"] for stage in summary["precision_manifest"]["stages"]}
    records = [r for r in summary["matmul_error"] if r["step"] in audited]
    assert records, "no matmul was measured on the audited step"
    ran = {(o["module"], o["direction"], o["format"]) for o in seen}
    for r in records:
        assert (r["module"], r["direction"], r["format"]) in ran, (r, sorted(ran))
    measured = {r["module"] for r in records if r["direction"] == "forward"}
    linears = {
        o["module"]
        for o in seen
        if o["direction"] == "forward" and (o["class"].endswith("Linear") or o["class"] == "Conv1D")
    }
    assert linears <= measured, linears - measured


def refused(cfg_overrides: list[str], pattern: str, out: Path) -> None:
    with pytest.raises(UserError) as caught:
        run(make_cfg(*cfg_overrides), out)
    line = str(caught.value)
    assert "\n" not in line and line.strip() == line, line
    assert re.search(pattern, line), line


def weights_dtype(mode: str) -> torch.dtype:
    return WEIGHTS.get(mode, torch.float32)


# --- the distributed cells: one launch of two ranks for all of them ---------------------------


DISTRIBUTED = [c for c in CELLS if c[1] in RANKS and refusal(*c[:2]) is None]


def shared_root(tmp_path_factory) -> Path:
    """The session's folder that every xdist worker sees (the basetemp's parent under xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _launch(root: Path, cells: list[tuple], folders) -> None:
    jobs = [(overrides(c, folders), root / cell_id(c)) for c in cells]
    for _, folder in jobs:
        folder.mkdir(parents=True)
    failure = None
    try:
        run_ranks(jobs)
    except Exception as e:  # a failed job stops the ranks: the cells after it fail too
        failure = f"{type(e).__name__}: {e}"
    finally:
        (root / "done.json").write_text(json.dumps({"failure": failure}))


@pytest.fixture(scope="module", autouse=True)
def rank_launch(request, tmp_path_factory, folders):
    """The selected DDP and FSDP cells, in one pair of rank processes (one start-up for all),
    started in the background when the first worker starts (an atomic claim on a file of the
    session's shared folder), so they train while the workers run the other cells; their cells
    come last and wait for it. (pytest 9's node ids ignore xdist_group's suffix, so --dist
    loadgroup alone does not keep them together.) Yields the root of their run folders."""
    root = shared_root(tmp_path_factory) / "ranks"
    cells = [
        item.callspec.params["cell"]
        for item in request.session.items
        if getattr(item, "callspec", None) and item.callspec.params.get("cell") in DISTRIBUTED
    ]
    launcher = None
    if cells:
        root.mkdir(exist_ok=True)
        try:
            os.close(os.open(root / "claimed", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:
            launcher = threading.Thread(target=_launch, args=(root, cells, folders))
            launcher.start()
    yield root
    if launcher is not None:
        launcher.join()


def rank_failure(root: Path) -> str | None:
    """Once the launch is done: the failure that stopped the ranks, if one did."""
    done, deadline = root / "done.json", time.monotonic() + PATIENCE_S
    while not done.exists():
        assert time.monotonic() < deadline, "the rank launch did not end"
        time.sleep(0.2)
    return json.loads(done.read_text())["failure"]


# --- the matrix -----------------------------------------------------------------------------

ORDER = sorted(CELLS, key=lambda c: c in DISTRIBUTED)  # last: they wait for the launch


def test_the_matrix_covers_every_pair():
    for (i, a), (j, b) in itertools.combinations(enumerate([MODES, FEATURES, MODELS]), 2):
        seen = {(c[i], c[j]) for c in CELLS}
        assert not [p for p in itertools.product(a, b) if p not in seen], (i, j)
    assert len(set(CELLS)) == len(CELLS)
    assert set(REQUIRED + AUTOPILOT) <= set(CELLS)


@pytest.mark.parametrize(
    "cell",
    [pytest.param(c, marks=marks(c)) for c in ORDER],
    ids=[cell_id(c) for c in ORDER],
)
def test_cell(cell, folders, tmp_path, monkeypatch, request):
    mode, feature, model = cell
    out = tmp_path / "run"
    why = refusal(mode, feature)
    if why is not None:
        refused(overrides(cell, folders), why, out)
        return
    if feature in RANKS:
        root = request.getfixturevalue("rank_launch")
        check_ranks(cell, root, rank_failure(root))
        return
    CHECKS.get(feature, check_plain)(cell, folders, out, monkeypatch)


def check_ranks(cell, root: Path, failure) -> None:
    folder = root / cell_id(cell)
    if not (folder / "summary.json").exists():
        raise AssertionError(f"no summary: the rank processes stopped ({failure})")
    summary = json.loads((folder / "summary.json").read_text())
    assert_manifest(summary)
    assert summary["world_size"] == WORLD
    reports = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["outcome"] for r in reports] == ["completed"] * WORLD
    assert [r["step"] for r in read_metrics(folder)] == [1, 2]


def check_plain(cell, folders, out, monkeypatch) -> None:
    """none (and keep_bf16 outside fp8): trains two finite steps, the checkpoint in the mode's
    weight dtype."""
    mode, feature, model = cell
    watch = Watch(monkeypatch)
    summary = run(make_cfg(*overrides(cell, folders)), out)
    assert_manifest(summary)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    big = f"{SPECS[model][4]}.weight"
    assert load_last(out)["model"][big].dtype == weights_dtype(summary["precision"])
    if feature == "keep_bf16":  # outside fp8 and mxfp8 it has no Linear to keep: nothing converts
        assert "fp8" not in summary
        assert not any(o["format"] in CONVERTING for o in ops(summary))
        assert not any(converted_class(m) for m in watch.task.modules())


def check_freeze(cell, folders, out, monkeypatch) -> None:
    """model.freeze: the frozen tensors byte-identical in the checkpoint to their initial values
    (in the dtype the mode holds them in), the others moved."""
    mode, _, model = cell
    watch = Watch(monkeypatch)
    summary = run(make_cfg(*overrides(cell, folders)), out)
    assert_manifest(summary)
    prefix = f"net.{SPECS[model][0]}."
    params = summary["precision_manifest"]["parameters"]
    frozen = {n for n, p in params.items() if not p["trainable"]}
    assert frozen and frozen == {n for n in params if n.startswith(prefix)}
    saved = load_last(out)["model"]
    for name in frozen:
        assert torch.equal(saved[name], watch.initial[name].to(saved[name].dtype)), name
    trained = [n for n in params if n not in frozen and n in saved and saved[n].dim() == 2]
    assert any(not torch.equal(saved[n], watch.initial[n].to(saved[n].dtype)) for n in trained)


def check_lora(cell, folders, out, monkeypatch) -> dict:
    """model.peft: only the adapters train (and the head peft saves for a classifier); the base
    is left out of the checkpoint or byte-identical there; LoRA's B (zero at the start) moved."""
    watch = Watch(monkeypatch)
    summary = run(make_cfg(*overrides(cell, folders)), out)
    assert_manifest(summary)
    params = summary["precision_manifest"]["parameters"]
    adapters = {n for n in params if ".lora_" in n or ".modules_to_save." in n}
    assert {n for n, p in params.items() if p["trainable"]} == adapters
    saved = load_last(out)["model"]
    for name, value in saved.items():
        if name not in adapters:
            assert torch.equal(value, watch.initial[name].to(value.dtype)), name
    moved = [k for k, v in saved.items() if ".lora_B" in k and v.abs().max() > 0]
    assert moved, "no adapter moved"
    if summary.get("converted"):  # the adapters stay in autocast's dtype (convert_adapters=false)
        assert not [n for n in summary["converted"]["converted"] if ".lora_" in n]
    return summary


def check_export(cell, folders, out, monkeypatch) -> None:
    """runner.export: the adapters load back in peft alone, equal to the checkpoint's."""
    import peft

    model = cell[2]
    check_lora(cell, folders, out, monkeypatch)
    exported = export(out)
    if model == "net":
        base = Net()
    elif model == "bert":
        base = transformers.BertForSequenceClassification.from_pretrained(folders["bert"])
    else:
        base = transformers.AutoModelForCausalLM.from_pretrained(folders[model])
    loaded = peft.PeftModel.from_pretrained(base, exported)
    got = {k: v for k, v in loaded.state_dict().items() if ".lora_" in k}
    trained = {
        k.removeprefix("net."): v for k, v in load_last(out)["model"].items() if ".lora_" in k
    }
    assert set(got) == set(trained) and trained
    for name, value in trained.items():
        assert torch.equal(got[name], value.float()), name


def check_islands(cell, folders, out, monkeypatch) -> None:
    """An explicit island or fp32_head: its ops fp32 in every direction, and its output fp32
    in every pass (a forward hook)."""
    mode, feature, model = cell
    _, _, island, head, _ = SPECS[model]
    name = island if feature == "islands" else head
    watch = Watch(monkeypatch, [name])
    summary = run(make_cfg(*overrides(cell, folders)), out)
    if feature == "fp32_head":
        assert summary["fp32_head"] == name
    assert_manifest(summary, [name])
    assert watch.outputs[name] == {torch.float32}, watch.outputs[name]
    if summary.get("converted"):
        converted = summary["converted"]["converted"]
        assert not [c for c in converted if under(c, name)], converted


def check_auto_islands(cell, folders, out, monkeypatch) -> None:
    """precision.fp32_modules=auto: the search's set is the run's islands (fp32 outputs, the
    manifest's fp32 ops); fp16 on the net with an overflowing layer finds that layer."""
    mode, _, model = cell
    watch = Watch(monkeypatch)
    summary = run(make_cfg(*overrides(cell, folders)), out)
    found = summary["fp32_islands"]
    assert found["found"] is True, found
    islands = found["fp32_modules"]
    assert_manifest(summary, islands)
    for name in islands:
        assert watch.outputs[name] == {torch.float32}, (name, watch.outputs[name])
    if model == "net" and mode in ("fp16", "fp16_master"):
        assert "net.blocks.1.0" in islands, found
        assert summary["skipped_steps"] == 0


def converted_class(module: nn.Module) -> bool:
    """Whether `module` is a converting mode's Linear: torchao's (fp8, mxfp8) or Fp4Linear."""
    return type(module).__module__.split(".")[0] == "torchao" or isinstance(module, Fp4Linear)


def check_keep_bf16(cell, folders, out, monkeypatch) -> None:
    """keep_bf16 (KEEP_BF16): the kept block's Linears are skipped with that reason and stay the
    model's own classes (the task's modules after preparation), the others convert."""
    mode = cell[0]
    if mode not in CONVERTING:
        return check_plain(cell, folders, out, monkeypatch)
    watch = Watch(monkeypatch)
    summary = run(make_cfg(*overrides(cell, folders)), out)
    assert_manifest(summary)
    reason = keep_bf16(mode)[1]
    kept = [n for n, why in summary["converted"]["skipped"].items() if reason in why]
    assert kept, summary["converted"]["skipped"]
    modules = dict(watch.task.named_modules())
    for name in kept:
        assert not converted_class(modules[name]), (name, type(modules[name]))
    for name in summary["converted"]["converted"]:
        assert converted_class(modules[name]), (name, type(modules[name]))
    low = {o["module"] for o in ops(summary) if o["format"] == mode}
    assert low and not low & set(kept), low & set(kept)
    return None


def check_eval_precisions(cell, folders, out, monkeypatch) -> None:
    """runner.eval_precisions=[bf16]: the fp32 reference row and the bf16 row, finite; where
    the manifest records the fp32 row, its every op in fp32 on fp32 inputs."""
    summary = run(make_cfg(*overrides(cell, folders)), out)
    assert_manifest(summary)
    rows = summary["eval_precisions"]
    assert list(rows)[:1] == ["fp32"] and "bf16" in rows, rows
    for name in ("fp32", "bf16"):
        assert rows[name]["status"] == "ok", rows[name]
        assert all(math.isfinite(v) for v in rows[name]["metrics"].values()), rows[name]
    evaluation = summary["precision_manifest"].get("evaluation")
    if evaluation is not None:
        recorded = [o for m in evaluation["fp32"]["modules"].values() for o in m["ops"]]
        assert recorded and {(o["format"], tuple(o["inputs"])) for o in recorded} == {
            ("fp32", ("fp32",))
        }


def check_resume(cell, folders, out, monkeypatch) -> None:
    """One step, then a resume to two in the same folder: metrics.jsonl continues the count,
    and the resumed run's manifest holds (resume_other: in PARTNER's mode, converted; both
    checkpoints in their mode's dtypes and the model's own layout)."""
    mode, feature, model = cell
    other = PARTNER[mode] if feature == "resume_other" else mode
    watch = Watch(monkeypatch)
    first = run(make_cfg(*overrides(cell, folders), "trainer.max_steps=1"), out)
    assert_manifest(first)
    initial = watch.initial
    written = load_last(out)
    [step_1] = read_metrics(out)
    resumed_overrides = [*overrides(cell, folders, mode=other), "trainer.resume=auto"]
    if other != mode:
        resumed_overrides.append("trainer.resume_across_precision=true")
    summary = run(make_cfg(*resumed_overrides), out)
    assert_manifest(summary)
    rows = read_metrics(out)  # step 1 as the first run wrote it (its timings too), then step 2
    assert [r["step"] for r in rows] == [1, 2] and rows[0] == step_1
    assert [s["step"] for s in summary["precision_manifest"]["stages"]] == [2]
    assert summary["precision_requested"] == other
    final = load_last(out)
    assert final["step"] == 2
    big = f"{SPECS[model][4]}.weight"
    assert written["model"][big].dtype == weights_dtype(first["precision"])
    assert final["model"][big].dtype == weights_dtype(summary["precision"])
    for state in (written, final):  # the model's own layout, whatever the mode converts
        assert {k: v.shape for k, v in state["model"].items()} == {
            k: v.shape for k, v in initial.items()
        }


def check_checkpointing(cell, folders, out, monkeypatch) -> None:
    """model.gradient_checkpointing: the manifest has recomputed forwards, and the hardware's
    FLOPs exceed the model's."""
    summary = run(make_cfg(*overrides(cell, folders)), out)
    assert_manifest(summary)
    assert any(o["direction"] == "recompute" for o in ops(summary))
    assert summary["hardware_flops_per_step"] > summary["flops_per_step"]


def check_compile(cell, folders, out, monkeypatch) -> None:
    """trainer.compile: Dynamo compiled the forward (graphs new in this run). Its cache is the
    process's, and an earlier cell of this worker may have compiled the same code: it starts
    empty here."""
    torch._dynamo.reset()
    if cell[2] != "net":
        # Inductor's C++ code for an HF model costs 20-90 s on this CPU: Dynamo and AOTAutograd
        # (the graphs, autocast and fp8 traced) without it; the net's cells run Inductor
        compile_module = nn.Module.compile
        monkeypatch.setattr(
            nn.Module,
            "compile",
            lambda self, *a, **k: compile_module(self, *a, **{**k, "backend": "aot_eager"}),
        )
    # The first step of each precision stage is audited, eagerly: a third step runs compiled
    # after staged's second stage starts at step 2
    summary = run(make_cfg(*overrides(cell, folders), "trainer.max_steps=3"), out)
    assert_manifest(summary)
    assert summary["compiled_graphs"] >= 1


def check_recipe(cell, folders, out, monkeypatch) -> None:
    """precision.recipe with one rule (recipe_file): the manifest (what the dispatcher saw) has
    the rule's module run that direction high and its other two in the mode's format, the plan
    held, and the module is the mode's converted class after preparation."""
    mode, _, model = cell
    name, direction = SPECS[model][4], RECIPE[mode]
    watch = Watch(monkeypatch)
    summary = run(make_cfg(*overrides(cell, folders)), out)
    assert_manifest(summary)
    assert name in summary["converted"]["converted"], summary["converted"]
    assert converted_class(dict(watch.task.named_modules())[name])
    mine = {}
    for o in ops(summary):
        if o["module"] == name and o["direction"] != "recompute":
            mine.setdefault(o["direction"], set()).add(o["format"])
    expected = {d: {mode} for d in ("forward", "input_grad", "weight_grad")}
    assert set(mine) == set(expected), mine
    assert mine[direction] <= {"bf16", "fp32"}, mine  # fp32: cpu_kernels=fast's bf16
    assert {d: f for d, f in mine.items() if d != direction} == {
        d: f for d, f in expected.items() if d != direction
    }, mine
    assert summary["converted"]["directions"][name][direction] == "bf16"


def check_autopilot(cell, folders, out, monkeypatch) -> None:
    """Every unit measured at step 1 under a floor it cannot meet: each converted Linear runs
    its low format at step 1 and none of it at step 2, audited after the switch, the plan of
    each step held (the manifest checks each stage against the plan in force at its step)."""
    mode, _, model = cell
    summary = run(make_cfg(*overrides(cell, folders)), out)
    assert_manifest(summary)
    converted = set(summary["converted"]["converted"])
    assert converted and {s["step"] for s in summary["autopilot"]["switches"]} == {2}
    assert {s["module"] for s in summary["autopilot"]["switches"]} == converted
    steps = [s["step"] for s in summary["precision_manifest"]["stages"]]
    assert steps == [1, 2], steps
    for stage, low in zip(summary["precision_manifest"]["stages"], (True, False), strict=True):
        formats = {
            o["format"]
            for name in converted
            for o in stage["modules"][name]["ops"]
            if o["direction"] != "recompute"
        }
        assert (mode in formats) == low, (stage["step"], formats)


CHECKS = {
    "autopilot": check_autopilot,
    "recipe": check_recipe,
    "freeze": check_freeze,
    "lora": check_lora,
    "export": check_export,
    "islands": check_islands,
    "fp32_head": check_islands,
    "auto_islands": check_auto_islands,
    "keep_bf16": check_keep_bf16,
    "eval_precisions": check_eval_precisions,
    "resume": check_resume,
    "resume_other": check_resume,
    "checkpointing": check_checkpointing,
    "compile": check_compile,
}
