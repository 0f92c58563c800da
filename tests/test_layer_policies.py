"""The per-layer policies of the largest trainers (issue 25 part 3): precision.fp8.keep_bf16 (the
first and last blocks' Linears left out of fp8 and MXFP8) and precision.fp32_head (a language
model's output projection, and so its loss, in fp32 in every mode). Read off the modules'
classes, the dtypes their forwards return and the checkpoint, with Hugging Face's GPT-2 classes
(model=gpt, model=hf) and a single-file GPT of the user's (model=module)."""

from __future__ import annotations

import pytest
import torch

from runner.config.validation import validate
from runner.errors import UserError
from runner.precision import Precision
from runner.run import build, run
from tests.helpers import TINY_MLP, load_last, make_cfg, read_metrics
from tests.test_hf import causal_lm_on_text, hf, tiny_gpt2_and_text
from tests.test_own_model import HERE as OWN_MODEL
from tests.test_own_model import TinyGPT

CPU = torch.device("cpu")
# A GPT-2 (transformers' GPT2LMHeadModel, lm_head tied to wte) of four blocks whose Linears are
# multiples of 32 wide (MXFP8's block), on the generated corpus.
GPT = [
    "model=gpt",
    "model.n_embd=32",
    "model.n_layer=4",
    "model.n_head=2",
    "model.dropout=0",
    "dataset.seq_len=32",
    "dataset.batch_size=4",
    "dataset.vocab_size=512",
    "dataset.num_documents=100",
    "trainer.max_steps=2",
    "trainer.val_check_interval=0",
    "trainer.progress_bar=false",
    "logger=none",
]
CONVERTED = {"fp8": "Float8Linear", "mxfp8": "MXFP8Linear"}  # torchao's converted classes


def _prepared(*overrides: str):
    cfg = make_cfg(*overrides)
    data, task = build(cfg)
    precision = Precision(cfg.precision, CPU)
    precision.prepare(task, cfg.precision.fp32_modules)
    return data, task, precision


@pytest.mark.parametrize("mode", CONVERTED)
def test_keep_bf16_leaves_the_first_and_last_blocks_out_of_the_low_precision_format(mode):
    pytest.importorskip("torchao")
    keep = ["precision.fp8.keep_bf16.first=1", "precision.fp8.keep_bf16.last=1"]
    _, task, precision = _prepared(*GPT, f"precision={mode}", "precision.fp8.skip=[]", *keep)
    classes = [  # GPT-2's projections: transformers' Conv1D, an nn.Linear stored transposed
        {type(m).__name__ for m in block.modules() if hasattr(m, "weight") and m.weight.ndim == 2}
        for block in task.model.transformer.h
    ]
    kept, converted = {"Conv1D"}, {CONVERTED[mode]}  # a kept block's are left as they are
    assert classes == [kept, converted, converted, kept]
    assert type(task.model.lm_head).__name__ == CONVERTED[mode]  # skip=[]: outside the blocks
    why = precision.converted.skipped["model.transformer.h.3.mlp.c_fc"]
    assert why == "in block 3 of 4 (precision.fp8.keep_bf16.last=1)"


def test_keep_bf16_changes_what_the_run_computes(tmp_path):
    """The first step's forward already differs: two blocks compute in bf16, not fp8."""
    pytest.importorskip("torchao")
    fp8 = [*GPT, "precision=fp8", "trainer.max_steps=1"]
    for first in (0, 2):
        run(make_cfg(*fp8, f"precision.fp8.keep_bf16.first={first}"), tmp_path / str(first))
    assert read_metrics(tmp_path / "0")[0]["loss"] != read_metrics(tmp_path / "2")[0]["loss"]


def test_keep_bf16_of_more_blocks_than_the_model_has_is_one_line():
    pytest.importorskip("torchao")
    keep = ["precision.fp8.keep_bf16.first=3", "precision.fp8.keep_bf16.last=2"]
    with pytest.raises(
        UserError, match=r"keep_bf16: first=3 and last=2 blocks, but the model has 4"
    ):
        _prepared(*GPT, "precision=fp8", *keep)


def test_a_model_without_blocks_keeps_none_and_says_so(capsys):
    """model=mlp has no nn.ModuleList or nn.Sequential of blocks: keep_bf16 (nvfp4's default
    keeps the last block) keeps nothing, a note says so, and the Linears convert by the other
    rules; the run goes on rather than failing a sweep's fp4 jobs."""
    pytest.importorskip("torchao")
    _, task, precision = _prepared(*TINY_MLP, "precision=nvfp4", "precision.fp4.skip=[]")
    said = " ".join(capsys.readouterr().err.split())  # the console wraps at its width
    assert "note: precision.fp4.keep_bf16 keeps no block: the model has none" in said
    # only the output layer stays, for its 8 classes: no Linear is kept for being in a block
    assert precision.converted.skipped == {"net.6": "dimensions 64×8 are not multiples of 16"}
    classes = [type(m).__name__ for m in task.modules() if isinstance(m, torch.nn.Linear)]
    assert classes.count("Fp4Linear") == len(classes) - 1 > 0


def test_validate_refuses_a_negative_keep_bf16():
    with pytest.raises(UserError) as err:
        validate(make_cfg("precision=fp8", "precision.fp8.keep_bf16.first=-1"))
    assert str(err.value).startswith("precision.fp8.keep_bf16.first=-1 is invalid: ")


def _head_output_dtype(task, precision, data) -> torch.dtype:
    """The dtype lm_head's forward returned on one batch, in the precision's forward."""
    seen = []
    hook = task.output_head().register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    batch = data.collate("train", [(0, 0, i) for i in range(2)])
    with precision.autocast():
        loss = task(batch)
    hook.remove()
    assert loss.dtype == torch.float32
    return seen[0]


# Each mode's low dtype: the head's output there without precision.fp32_head
LOW = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp16_master": torch.float16,
    "bf16_true": torch.bfloat16,
    "fp8": torch.bfloat16,
}


@pytest.mark.parametrize("mode", LOW)
def test_fp32_head_computes_the_logits_in_fp32_in_every_mode(mode):
    if mode == "fp8":
        pytest.importorskip("torchao")
    cfg = [*GPT, "model.n_layer=1", f"precision={mode}"]
    data, task, precision = _prepared(*cfg, "precision.fp32_head=true")
    assert precision.fp32_head == "model.lm_head"
    assert _head_output_dtype(task, precision, data) == torch.float32
    assert task.model.lm_head.weight.dtype == torch.float32  # the tied wte's too
    assert task.model.transformer.wte.weight is task.model.lm_head.weight
    data, task, precision = _prepared(*cfg)
    assert _head_output_dtype(task, precision, data) == LOW[mode]


class LossDtypeGPT(TinyGPT):
    """TinyGPT, noting the dtype of the loss its own forward computes (model.loss=output)."""

    loss_dtypes: list[torch.dtype] = []

    def forward(self, idx, targets=None):
        logits, loss = super().forward(idx, targets)
        if loss is not None:
            LossDtypeGPT.loss_dtypes.append(loss.dtype)
        return logits, loss


@pytest.mark.parametrize("fp32_head, expected", [(True, torch.float32), (False, torch.bfloat16)])
def test_a_users_gpt_computes_its_loss_in_fp32_under_bf16_true(tmp_path, fp32_head, expected):
    """bf16_true has no autocast: a net that computes its own loss computes it in the dtype of
    its logits, fp32 only out of an fp32 head (the net's last Linear, `head`)."""
    LossDtypeGPT.loss_dtypes = []
    cfg = make_cfg(
        "model=module",
        f"model.net._target_={__name__}.LossDtypeGPT",
        "model.loss=output",
        f"dataset.train._target_={OWN_MODEL}.token_pairs",
        "dataset.batch_size=8",
        "trainer.max_steps=2",
        "trainer.val_check_interval=0",
        "trainer.progress_bar=false",
        "logger=none",
        "precision=bf16_true",
        f"precision.fp32_head={str(fp32_head).lower()}",
    )
    summary = run(cfg, tmp_path)
    assert summary["fp32_head"] == ("net.head" if fp32_head else None)
    assert set(LossDtypeGPT.loss_dtypes[-2:]) == {expected}  # the two training steps'
    assert load_last(tmp_path)["model"]["net.head.weight"].dtype == expected


def test_a_hugging_face_gpt2_keeps_its_tied_head_fp32_in_the_checkpoint(tmp_path):
    """model=hf: the head is transformers' get_output_embeddings() (lm_head, tied to wte); under
    bf16_true the shared weight stays fp32, the blocks' weights are bf16, and precision truth
    finds nothing held other than the config asks."""
    folder, text = tiny_gpt2_and_text(tmp_path, documents=50)
    cfg = hf(
        folder,
        *causal_lm_on_text(text),
        "dataset.seq_len=32",
        "dataset.batch_size=4",
        "trainer.max_steps=2",
        "trainer.val_check_interval=0",
        "precision=bf16_true",
        "precision.fp32_head=true",
    )
    summary = run(cfg, tmp_path / "run")
    assert summary["fp32_head"] == "net.lm_head"
    assert summary["precision_truth"]["mismatches"] == []
    weights = load_last(tmp_path / "run")["model"]
    assert weights["net.lm_head.weight"].dtype == torch.float32
    assert weights["net.transformer.wte.weight"].dtype == torch.float32  # tied: one tensor
    assert weights["net.transformer.h.0.mlp.c_fc.weight"].dtype == torch.bfloat16


def test_fp32_head_on_a_task_without_one_is_one_line():
    with pytest.raises(UserError, match="precision.fp32_head=true: MLPClassifier has no output"):
        _prepared(*TINY_MLP, "precision=bf16", "precision.fp32_head=true")
