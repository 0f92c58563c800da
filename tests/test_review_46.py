"""Review of issue 46 (per-layer precision: recipes, error figures, the recipe search):
failing tests for what the review found. Each test's docstring says what the tool must do."""

import functools
from pathlib import Path

import pytest
import torch

from runner.errors import UserError
from runner.run import run
from tests.helpers import make_cfg
from tests.test_fp4 import _gpt

gpt = functools.partial(_gpt, layers=2)


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_a_resumed_run_is_held_to_its_recipe_files_content(tmp_path):
    """A run's folder continued (trainer.resume=auto) after its recipe file was edited in place
    (same path, other rules) would continue the old run under other per-layer formats: as with
    any other changed value (docs/distributed.md "Reruns"), it must be refused before any step,
    naming precision.recipe, not resumed silently with the new file's rules."""
    recipe = tmp_path / "r.yaml"
    _write(recipe, 'rules:\n  - {module: "net.blocks.0.proj", weight_grad: bf16}\n')
    args = ("precision=nvfp4", f"precision.recipe={recipe}", "trainer.checkpoint_every_n_steps=2")
    run(make_cfg(*gpt(*args, steps=4)), tmp_path / "run")
    _write(
        recipe,
        'rules:\n  - {module: "net.blocks.1.*", forward: bf16, input_grad: bf16, weight_grad: bf16}\n',
    )
    with pytest.raises(UserError, match="precision.recipe"):
        run(make_cfg(*gpt(*args, "trainer.resume=auto", steps=8)), tmp_path / "run")


def test_a_finished_run_is_not_read_back_under_an_edited_recipe_file(tmp_path):
    """A finished run's folder run again (the same command, as a sweep's rerun does) after its
    recipe file was edited in place: its summary.json describes the old rules, yet it is read
    back as this command's result. It must be refused, naming precision.recipe (as "the run had
    finished, so X would not apply" does for any other changed value)."""
    recipe = tmp_path / "r.yaml"
    _write(recipe, 'rules:\n  - {module: "net.blocks.0.proj", weight_grad: bf16}\n')
    args = gpt("precision=nvfp4", f"precision.recipe={recipe}", "trainer.resume=auto", steps=2)
    first = run(make_cfg(*args), tmp_path / "run")
    _write(recipe, 'rules:\n  - {module: "net.blocks.1.*", forward: bf16, input_grad: bf16}\n')
    with pytest.raises(UserError, match="precision.recipe"):
        again = run(make_cfg(*args), tmp_path / "run")
        assert again["converted"]["recipe_in_force"] != first["converted"]["recipe_in_force"]


# --- the search's process: signals and a second search into its folder ----------------------

SEARCH = [
    "model=module",
    "model.net._target_=tests.test_recipe_search.Outliers",
    "dataset.train._target_=tests.test_own_model.pairs",
    "dataset.batch_size=16",
    "trainer.val_check_interval=0",
    "trainer.progress_bar=false",
    "logger=none",
    "precision=nvfp4",
    "trainer.max_steps=32",
    "runner.recipe_steps=32",
    "trainer.cpu_threads=1",
]


def _search(out: Path, cwd: Path):
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    return subprocess.Popen(
        [sys.executable, "-m", "runner.recipe", *SEARCH, f"hydra.run.dir={out}"],
        cwd=cwd,
        env=os.environ | {"PYTHONPATH": str(repo)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, proc, timeout: float = 120.0) -> None:
    import time

    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, "the search ended before it got there"
        assert time.monotonic() < end
        time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_during_a_search_is_one_line_exit_75_not_a_traceback(tmp_path):
    """SIGTERM to `python -m runner.recipe` while a trial trains: the command says so in words
    (preempted by SIGTERM ...; how to continue: run the same command) and exits 75, as `python
    -m runner` does (docs/distributed.md "Reruns"); today it is Hydra's traceback of
    runner.errors.Preempted, exit 1. Its words must be true: a trial writes no checkpoint
    (docs: "without evaluation or checkpoints"), yet it says "checkpoint saved" with no .pt
    file anywhere in the folder."""
    import signal

    proc = _search(tmp_path / "out", tmp_path)
    _wait_for(tmp_path / "out" / "trial-1" / "metrics.jsonl", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err, err
    assert proc.returncode == 75, (proc.returncode, err)
    assert "preempted by SIGTERM" in err
    if not list((tmp_path / "out").rglob("*.pt")):
        assert "checkpoint saved" not in err, err


@pytest.mark.slow
def test_a_second_search_into_a_searching_folder_is_refused(tmp_path):
    """Two `python -m runner.recipe` commands into one folder at once would write the same
    trial-N folders, recipe.yaml and recipe_search.json together: the second must be refused
    in one line, exit 2, as a second `python -m runner` over a run's folder is ("is in use by
    process ..."), not run beside the first (today both run, exit 0)."""
    first = _search(tmp_path / "out", tmp_path)
    try:
        _wait_for(tmp_path / "out" / "trial-0" / "metrics.jsonl", first)
        second = _search(tmp_path / "out", tmp_path)
        assert first.poll() is None  # the first still searching as the second starts
        _, err = second.communicate(timeout=300)
        assert second.returncode == 2, (second.returncode, err[-2000:])
        assert "in use" in err and len(err.strip().splitlines()) == 1, err
    finally:
        first.kill()
        first.communicate()


def test_the_exported_filter_converts_gpt2s_conv1d_projections_under_torchao(tmp_path):
    """model=gpt (transformers' GPT-2, its projections Conv1D): an fp8 run converts its 8 block
    projections (the runner swaps each Conv1D for the Linear it computes). The recipe_filter.py
    written for that run says "Use: convert_to_float8_training(model, module_filter_fn=...)";
    applied so to the same GPT-2, torchao converts none of them (it swaps nn.Linear only), and
    the user's training runs them in bf16 where the search's runs had fp8. The filter's use must
    convert the Linears the recipe converts, or the file must say in words that these modules
    are Conv1D, which torchao's converter leaves as they are (and what to do)."""
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear
    from transformers import GPT2Config, GPT2LMHeadModel

    from runner.answers import recipe_export

    summary = run(
        make_cfg(
            "model=gpt",
            "model.n_layer=2",
            "model.n_embd=32",
            "model.dropout=0",
            "dataset.seq_len=32",
            "dataset.batch_size=8",
            "trainer.max_steps=1",
            "trainer.val_check_interval=0",
            "trainer.progress_bar=false",
            "logger=none",
            "precision=fp8",
            "precision.fp8.skip=[]",
        ),
        tmp_path / "run",
    )
    converted = summary["converted"]["converted"]
    assert len(converted) == 8, converted  # the 8 block projections
    recipe_export.write(tmp_path, "fp8", summary["converted"], "a test", "model.")
    text = (tmp_path / recipe_export.FILTER_FILE).read_text()
    scope: dict = {}
    exec(compile(text, "recipe_filter.py", "exec"), scope)  # noqa: S102
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256))
    convert_to_float8_training(model, module_filter_fn=scope["module_filter_fn"])
    in_fp8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    wanted = {n.removeprefix("model.") for n in converted}
    assert in_fp8 == wanted or "Conv1D" in text, (sorted(in_fp8), text)


@pytest.mark.slow
def test_two_recipe_files_of_one_name_are_two_rows_told_apart(tmp_path):
    """A sweep over precision.recipe=a/r.yaml,b/r.yaml (two recipes, one file name, in two
    folders) gives two comparison rows both labelled "nvfp4 recipe=r.yaml": the table and the
    verdicts ("nvfp4 recipe=r.yaml ... within 0.02% of nvfp4 recipe=r.yaml") cannot say which
    recipe is which. Each row's label must name its recipe apart from the others'."""
    import json

    from tests.helpers import cli

    for folder, rule in (
        ("a", '{module: "net.blocks.0.proj", weight_grad: bf16}'),
        ("b", '{module: "net.blocks.1.*", forward: bf16, input_grad: bf16, weight_grad: bf16}'),
    ):
        (tmp_path / folder).mkdir()
        _write(tmp_path / folder / "r.yaml", f"rules:\n  - {rule}\n")
    proc = cli(
        "-m",
        *gpt("precision=nvfp4", steps=2),
        f"precision.recipe={tmp_path / 'a' / 'r.yaml'},{tmp_path / 'b' / 'r.yaml'}",
        f"hydra.sweep.dir={tmp_path / 'S'}",
        cwd=Path(__file__).resolve().parents[1],  # tests.test_own_model importable
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "S" / "compare.json").read_text())
    labels = [r["label"] for r in rows]
    assert len(labels) == 2 and len(set(labels)) == 2, labels


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_linears_bias_rounding_is_not_charged_to_its_products_sqnr(dtype):
    """A Linear with a bias (nn.Linear's default, ±0.125) on small inputs (1e-6, as after a
    small-gain norm): the product x·Wᵀ loses 29 dB's worth in fp16 (the same Linear without a
    bias measures 29.3 dB), the output x·Wᵀ+b 75 dB. The probe measures -26 dB: it takes the
    run's output less the fp32 bias as the product, so the bias's own rounding (at the bias's
    magnitude, far above the product's) is charged to the product, and the layer reads as
    losing everything. The forward SQNR must be the product's (or the output's), not the bias's
    rounding against the product."""
    from runner.measure.matmul_error import ErrorProbe

    def forward_sqnr(bias: bool) -> float:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=bias))
        x = torch.randn(256, 64) * 1e-6
        with ErrorProbe(net, 1, converted=False) as probe:
            with torch.autocast("cpu", dtype):
                y = net(x)
            y.float().sum().backward()
        return next(r["sqnr_db"] for r in probe.records() if r["direction"] == "forward")

    without = forward_sqnr(False)
    assert without > 20  # the product's own rounding
    assert forward_sqnr(True) >= without - 3.0


def test_keep_bf16_last_keeps_the_models_last_block_not_a_linear_of_its_first(tmp_path):
    """nvfp4's keep_bf16.last=1 ("the model's last block in bf16", the paper's recipe) on a
    2-block TinyGPT (net.blocks, an nn.ModuleList of 2 Blocks, each with an nn.Sequential MLP of
    3) keeps net.blocks.0.mlp.2, "in block 2 of 3": the first block's MLP is taken for the
    model's blocks, being the longer container, and the model's last block (net.blocks.1)
    converts whole. keep_bf16 must keep the model's last block (net.blocks.1's Linears) and
    nothing of net.blocks.0."""
    summary = run(make_cfg(*gpt("precision=nvfp4", steps=1)), tmp_path)
    skipped = summary["converted"]["skipped"]
    kept = {n for n, why in skipped.items() if "keep_bf16" in why}
    assert not any(n.startswith("net.blocks.0.") for n in kept), skipped
    assert {f"net.blocks.1.{n}" for n in ("qkv", "proj", "mlp.0", "mlp.2")} <= kept, skipped
