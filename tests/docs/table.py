"""THE table of the docs' commands (issue 51): every shell command in README.md and docs/*.md, as
written (continuation lines joined, the trailing comment dropped), with what the test appends.

A command the docs gain without an entry here fails `make test`
(tests/docs/test_docs_commands.py::test_every_docs_command_has_an_entry); an entry whose command
the docs no longer hold fails it too. To add one: run `make test`, copy the command from the
failure into COMMANDS, and give it

- `size`: overrides appended to the command, sizes only (steps, batch, sequence length, model
  and dataset dimensions, evaluation and timing counts), so it runs at test size;
- `slow`: True where the block takes over 10 s (every `python -m runner` does: its imports
  alone take 8 s here), so it runs in `make test-slow`, not `make test`.

Only where the command cannot run as written here, and then with `why`: `replace` (a
placeholder the reader fills in: (old, new) pairs), `setup` (shell run first in the command's
folder: what the reader brings, made by tests/docs/supply.py), `env` (variables added),
`status` (the exit status expected, where the docs show another or this machine differs) or
`dry` (a check run instead of the command: installs from the network, the suite itself, a
script another test runs). `{repo}` in these is the repository's root, `{tmp}` the command's
folder. Blocks that need the cluster or a GPU say so in the docs (`<!--pytest.mark.cluster-->`,
`<!--pytest.mark.gpu-->` above the block): they run in `make test-cluster` and
scripts/gpu_check.sh."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Entry:
    size: str = ""
    slow: bool = True
    why: str = ""
    replace: tuple[tuple[str, str], ...] = ()
    setup: str = ""
    env: dict = field(default_factory=dict)
    status: int | None = None
    dry: str = ""


STEPS = "trainer.max_steps=2 trainer.val_check_interval=2 trainer.limit_val_batches=1"
BERT = (
    "model.hidden_size=32 model.num_hidden_layers=1 model.num_attention_heads=2 "
    "model.intermediate_size=64 dataset.seq_len=16 dataset.num_documents=60 "
    "dataset.vocab_size=512"
)
TINY_BERT = f"{BERT} dataset.batch_size=4 {STEPS}"
GPT = "model.n_embd=32 model.n_layer=1 model.n_head=2 dataset.seq_len=16 dataset.num_documents=60"
MLP = "dataset.num_samples=256"
TIMING = "runner.speed_rounds=3 runner.speed_steps=1"

MAKE = "the target installs .venv from the network (scripts/setup.sh) and trains at full size: `make -n` checks the target and its recipe; the runner command it runs is README's first, run above"
PIP = "pip installs from the network and the tests never download: the check is that what it installs imports (scripts/cluster.sh up installs it; make setup the rest)"
SWEEP_HERE = "the docs' folder is an example of the sweep folder the command before wrote: the test moves that sweep there"
DOC_TMP = (
    "/tmp/doc is the docs' own machine's folder: the test's folder instead (tests run side by side)"
)

COMMANDS: dict[str, Entry] = {
    # README.md, docs/index.md
    "python -m runner precision=bf16 model=bert": Entry(TINY_BERT),
    "python -m runner -m precision=fp32,fp16,bf16 model=bert": Entry(TINY_BERT),
    "python -m runner.compare multirun/2026-11-29/10-00-00": Entry(
        setup="mkdir -p multirun/2026-11-29 && mv $(ls -d multirun/*/* | head -1) multirun/2026-11-29/10-00-00",
        why=SWEEP_HERE,
    ),
    "python -m runner -m +launcher=slurm precision=fp32,bf16 model=bert hydra.sweep.dir=sweeps/bert": Entry(
        TINY_BERT,
        status=2,
        why="the test cluster's partition has no GPU: refused in one line, exit 2, as docs/distributed.md shows",
    ),
    "make run": Entry(dry="make -n -C {repo} run", slow=False, why=MAKE),
    "make sweep": Entry(dry="make -n -C {repo} sweep", slow=False, why=MAKE),
    "make test": Entry(
        dry="make -n -C {repo} test",
        slow=False,
        why="the suite itself (CI runs it): `make -n` checks the target",
    ),
    "bash scripts/gpu_wheels.sh": Entry(
        dry="bash -n {repo}/scripts/gpu_wheels.sh",
        slow=False,
        why="downloads wheels from PyPI: tests/e2e/test_gpu_check_dry.py (slow) runs it",
    ),
    "GPU_PY_VERSION=3.11 bash scripts/gpu_wheels.sh ~/.cache/amp-runner/gpu-wheels-py3.11": Entry(
        dry="bash -n {repo}/scripts/gpu_wheels.sh",
        slow=False,
        why="downloads wheels from PyPI: tests/e2e/test_gpu_check_dry.py (slow) runs it",
    ),
    "GPU_CHECK_DRY=1 GPU_WHEELS=~/.cache/amp-runner/gpu-wheels-py3.11 bash scripts/gpu_check.sh /tmp/gpu-dry": Entry(
        dry="bash -n {repo}/scripts/gpu_check.sh",
        slow=False,
        why="builds a fresh venv from PyPI: tests/e2e/test_gpu_check_dry.py (slow) runs it",
    ),
    "bash scripts/gpu_check.sh": Entry(
        dry="bash -n {repo}/scripts/gpu_check.sh",
        slow=False,
        why="the GPU machine's whole check, which runs this suite's gpu tests: not from inside it",
    ),
    # docs/answers.md
    "python -m runner experiment=max_batch model=bert trainer.device=cuda": Entry(TINY_BERT),
    "python -m runner experiment=max_batch model=bert runner.memory_budget_gb=H100": Entry(
        TINY_BERT
    ),
    "python -m runner experiment=max_batch model=bert runner.memory_budget_gb=0.5": Entry(
        TINY_BERT
    ),
    "python -m runner model=resnet trainer.max_steps=200 'runner.eval_precisions=[fp32,bf16,fp16,fp16_cast,bf16_cast]'": Entry(
        f"{STEPS} dataset.num_samples=64 dataset.image_size=16 dataset.batch_size=8"
    ),
    # docs/comparison.md
    "python -m runner experiment=amp_check model=bert": Entry(
        f"{BERT} dataset.batch_size=4 trainer.max_steps=4 trainer.val_check_interval=2 trainer.limit_val_batches=1 {TIMING}"
    ),
    "python -m runner experiment=amp_check precision=fp32,tf32,fp16,bf16 trainer.device=cuda": Entry(
        f"{BERT} dataset.batch_size=4 trainer.max_steps=4 trainer.val_check_interval=2 trainer.limit_val_batches=1 {TIMING}"
    ),
    # docs/configuration.md
    "python -m runner precision=fp16 precision.grad_scaler.init_scale=1024": Entry(TINY_BERT),
    "python -m runner precision=bf16 trainer.accumulate_grad_batches=4 dataset.batch_size=4": Entry(
        f"{BERT} {STEPS}"
    ),
    "python -m runner precision=auto model=bert_base trainer.device=cuda": Entry(TINY_BERT),
    "python -m runner dataset=text_files 'dataset.data_files=\"~/corpus/*.txt\"' dataset.seq_len=256": Entry(
        f"{BERT} dataset.batch_size=4 {STEPS}".replace("dataset.num_documents=60 ", ""),
        setup="PYTHONPATH={repo} python -m tests.docs.supply corpus $HOME/corpus/a.txt",
        env={"HOME": "{tmp}"},
        why="~/corpus is the reader's text: a small corpus made there, in a home folder of the test's own",
    ),
    "python -m runner --cfg job precision=fp16": Entry(),
    # docs/distributed.md
    "torchrun --nproc_per_node=4 -m runner precision=bf16 model=bert_base": Entry(TINY_BERT),
    "torchrun --nproc_per_node=4 -m runner precision=bf16 trainer.strategy=fsdp model=gpt2": Entry(
        f"{GPT} dataset.batch_size=4 {STEPS}"
    ),
    "python -m runner -m +launcher=slurm_ddp hydra.launcher.nodes=2 precision=fp32,bf16": Entry(
        TINY_BERT,
        status=2,
        why="the test cluster is one node without a GPU: refused in one line, exit 2",
    ),
    'sinfo -N -o "%P %N %c %m %G"': Entry(slow=False),
    "python -m runner -m +launcher=slurm precision=fp32,bf16 model=mlp hydra.sweep.dir=/tmp/doc/refused": Entry(
        MLP, replace=(("/tmp/doc/", "doc/"),), why=DOC_TMP
    ),
    "python -m runner -m +launcher=slurm precision=fp32,bf16 model=mlp hydra.launcher.gpus_per_node=0 trainer.max_steps=30 hydra.sweep.dir=/tmp/doc/sweep": Entry(
        f"{MLP} trainer.max_steps=6", replace=(("/tmp/doc/", "doc/"),), why=DOC_TMP
    ),
    "python -m runner -m +launcher=slurm precision=fp32,bf16 model=mlp hydra.launcher.gpus_per_node=0 hydra.launcher.cpus_per_task=1 hydra.launcher.mem_gb=1 trainer.max_steps=2000 trainer.checkpoint_every_n_steps=100 trainer.val_check_interval=0 trainer.progress_bar=false hydra.sweep.dir=/tmp/doc/cancel": Entry(
        MLP,
        replace=(("/tmp/doc/", "doc/"),),
        setup="( for i in $(seq 1200); do f=$(ls -d doc/cancel/.submitit/*_1 2>/dev/null | head -1); "
        'if [ -n "$f" ] && grep -qs "checkpoint\\|step" "$f"/*_log.err; then scancel "$(basename "$f")"; exit; fi; sleep 0.25; done ) &',
        why=DOC_TMP
        + "; the docs cancel job 1 while it trains (`scancel`): the test does, in the background",
    ),
    "python -m runner -m +launcher=slurm precision=fp32,bf16 model=mlp ... hydra.sweep.dir=/tmp/doc/cancel": Entry(
        MLP,
        replace=(
            ("/tmp/doc/", "doc/"),
            (
                " ... ",
                " hydra.launcher.gpus_per_node=0 hydra.launcher.cpus_per_task=1 hydra.launcher.mem_gb=1 trainer.max_steps=2000 trainer.checkpoint_every_n_steps=100 trainer.val_check_interval=0 trainer.progress_bar=false ",
            ),
        ),
        why=DOC_TMP + "; `...` is the command before's overrides (the same command completes it)",
    ),
    'grep -h "resumed" /tmp/doc/cancel/.submitit/158/158_0_log.err': Entry(
        slow=False,
        replace=(
            ("/tmp/doc/cancel/.submitit/158/158_0_log.err", "doc/cancel/.submitit/*/*_0_log.err"),
        ),
        why="158 is the docs' job id: the test's cluster numbers its own",
    ),
    "sacct -X -o JobID,JobName%10,State,ExitCode -S now-5minutes": Entry(slow=False),
    "pip install -e '.[ray]'": Entry(
        dry="python -c 'import ray, hydra_plugins.hydra_ray_launcher'", slow=False, why=PIP
    ),
    "python -m runner -m +launcher=ray precision=fp32,bf16": Entry(
        TINY_BERT,
        env={"RAY_ADDRESS": ""},
        why="a local Ray, started for the sweep: without the test cluster's RAY_ADDRESS",
    ),
    "RAY_ADDRESS=head:6379 python -m runner -m +launcher=ray precision=fp32,bf16 runner.seeds=2": Entry(
        TINY_BERT,
        replace=(("head:6379", "$RAY_ADDRESS"),),
        why="`head` is the reader's head: the test cluster's",
    ),
    "RAY_ADDRESS=127.0.0.1:35723 python -m runner -m +launcher=ray model=mlp precision=fp32,bf16 runner.seeds=2 trainer.max_steps=40 hydra.sweep.dir=sweeps/ray-demo": Entry(
        f"{MLP} trainer.max_steps=8",
        replace=(("127.0.0.1:35723", "$RAY_ADDRESS"),),
        why="the docs' head's port: the test cluster's",
    ),
    "cat sweeps/ray-demo/compare.md (columns cut)": Entry(
        slow=False,
        replace=((" (columns cut)", ""),),
        why="`(columns cut)` is the docs' note on the output, not part of the command",
    ),
    # docs/lora.md
    "python -m runner -m precision=fp32,bf16,fp16,bf16_true model=hf model.task=causal_lm model.name_or_path=path/to/llama 'model.peft={r:8,alpha:16,target_modules:[q_proj,v_proj]}' dataset=text_files dataset.data_files=corpus.txt": Entry(
        f"dataset.seq_len=16 dataset.batch_size=4 {STEPS}",
        setup="PYTHONPATH={repo} python -m tests.docs.supply llama path/to/llama && PYTHONPATH={repo} python -m tests.docs.supply corpus corpus.txt",
        why="path/to/llama and corpus.txt are the reader's: a tiny Llama saved with save_pretrained and a small corpus, made offline",
    ),
    "python -m runner.export multirun/.../3": Entry(
        replace=(("multirun/.../3", "multirun/*/*/3"),),
        why="`...` is the sweep's DATE/TIME, which the command before chose",
    ),
    # docs/own-model.md
    "python -m runner -m precision=fp32,bf16,fp16 model=module model.net._target_=mypkg.nets.Net +model.net.width=64 model.loss=cross_entropy dataset=torch dataset.train._target_=mypkg.data.train_set dataset.validation._target_=mypkg.data.val_set": Entry(
        f"dataset.batch_size=16 {STEPS}",
        setup="PYTHONPATH={repo} python -m tests.docs.supply mypkg",
        env={"PYTHONPATH": "{tmp}"},
        why="mypkg is the reader's package on PYTHONPATH: a small one (tests/docs/supply.py) in the folder",
    ),
    "python -m runner hydra.searchpath=[pkg://mypkg.conf] model=stripes": Entry(
        f"dataset.batch_size=16 {STEPS}",
        env={"PYTHONPATH": "{repo}/examples"},
        why="the docs' mypkg is examples/mypkg, on PYTHONPATH as the next command puts it",
    ),
    "PYTHONPATH=path/to/amp-runner/examples python -m runner -m precision=fp32,bf16,fp16 hydra.searchpath=[pkg://mypkg.conf] model=stripes": Entry(
        f"dataset.batch_size=16 {STEPS}",
        replace=(("path/to/amp-runner", "{repo}"),),
        why="path/to/amp-runner is the reader's checkout: this one",
    ),
    "python -m runner precision=bf16 model=hf model.task=sequence_classification model.name_or_path=bert-base-uncased model.pretrained=true dataset=text_classification dataset.path=glue dataset.name=sst2": Entry(
        dry="python -m runner --cfg job precision=bf16 model=hf model.task=sequence_classification model.name_or_path=bert-base-uncased model.pretrained=true dataset=text_classification dataset.path=glue dataset.name=sst2",
        why="downloads bert-base-uncased and GLUE from the Hub, which the tests never do: the command composes (`--cfg job`); tests/test_hf.py and test_text_classification.py run the same path on a save_pretrained folder and local files",
    ),
    # docs/precision-modes.md
    "python -m runner.islands model=module model.net._target_=tests.test_island_search.Loud dataset.train._target_=tests.test_own_model.pairs dataset.batch_size=16 trainer.max_steps=50 logger=none precision=fp16": Entry(
        "trainer.max_steps=10",
        env={"PYTHONPATH": "{repo}"},
        why="the docs' net is the repository's tests.test_island_search.Loud: the repository on PYTHONPATH",
    ),
    "python -m runner -m precision=fp32,bf16 ... hydra.sweep.dir=S": Entry(
        dry="test -f {repo}/tests/e2e/test_recipe_sweep.py",
        slow=False,
        why="a pattern: `...` is the reader's model and data, and the recipe files theirs; tests/e2e/test_recipe_sweep.py (slow) runs the two commands filled in",
    ),
    "python -m runner -m precision=nvfp4 precision.recipe=one_wgrad.yaml,block1.yaml ... hydra.sweep.dir=S 'hydra.sweep.subdir=recipe${hydra.job.num}'": Entry(
        dry="test -f {repo}/tests/e2e/test_recipe_sweep.py",
        slow=False,
        why="a pattern: `...` is the reader's model and data, and the recipe files theirs; tests/e2e/test_recipe_sweep.py (slow) runs the two commands filled in",
    ),
    'GPT="model=gpt model.n_layer=4 model.n_embd=32 model.dropout=0 dataset.seq_len=32 dataset.batch_size=8 optim.optimizer.lr=3e-3 trainer.max_steps=500 runner.recipe_steps=500"': Entry(
        slow=False
    ),
    "python -m runner precision=fp8 model=gpt precision.autopilot=true": Entry(
        f"{GPT} {STEPS} precision.autopilot.every_n_steps=1"
    ),
    "python -m runner -m precision=nvfp4 model=gpt precision.autopilot=true,false": Entry(
        f"{GPT} {STEPS} precision.autopilot.every_n_steps=1"
    ),
    "python -m runner.recipe precision=mxfp8 $GPT 'precision.fp8.skip=[]' compare.tolerance=0.005": Entry(
        "model.n_layer=2 dataset.seq_len=16 dataset.num_documents=60 trainer.max_steps=6 runner.recipe_steps=6"
    ),
    "python -m runner.recipe precision=mxfp8 $GPT 'precision.fp8.skip=[]' compare.tolerance=0.001 runner.recipe_max=2": Entry(
        "model.n_layer=2 dataset.seq_len=16 dataset.num_documents=60 trainer.max_steps=6 runner.recipe_steps=6"
    ),
    # docs/projection.md
    "python -m runner.project model=bert": Entry(BERT),
    "python -m runner.project model=gpt runner.project=[H100,B200,GB200] runner.project_precisions=[bf16,fp8,mxfp8]": Entry(
        GPT
    ),
    "python -m runner precision=bf16 model=bert runner.project=[H100]": Entry(TINY_BERT),
    "python -m runner.project -m model=bert model.hidden_size=256,1024,4096 runner.project=[H100,B200] runner.project_precisions=[bf16,fp8]": Entry(
        "dataset.seq_len=16 dataset.batch_size=2 dataset.num_documents=60 dataset.vocab_size=512",
        replace=(("model.hidden_size=256,1024,4096", "model.hidden_size=32,64,128"),),
        why="the swept sizes are sizes, but a sweep's values are replaced, not appended (appended, Hydra sweeps their product): 4096 audits for minutes on 2 cores",
    ),
    # docs/quickstart.md
    "python -m venv .venv && . .venv/bin/activate": Entry(
        dry="make -n -C {repo} setup",
        slow=False,
        why="with the next: what `make setup` does (scripts/setup.sh), from the network",
    ),
    'pip install -e ".[dev]"': Entry(
        dry="python -c 'import pytest_codeblocks, xdist'", slow=False, why=PIP
    ),
    "python -m pytest -q -n 2 --dist loadgroup": Entry(
        dry="make -n -C {repo} test", slow=False, why="the suite itself (CI runs it)"
    ),
    # docs/testing.md
    "bash scripts/cluster.sh up": Entry(
        dry="bash -n {repo}/scripts/cluster.sh",
        slow=False,
        why="`make test-cluster` runs these four, around the cluster tests (these among them)",
    ),
    "set -a; . /tmp/amp-runner-cluster/env; set +a": Entry(
        dry="bash -n {repo}/scripts/cluster.sh",
        slow=False,
        why="`make test-cluster` runs these four, around the cluster tests (these among them)",
    ),
    ".venv/bin/python -m pytest -m cluster": Entry(
        dry="make -n -C {repo} test-cluster",
        slow=False,
        why="`make test-cluster` runs these four, around the cluster tests (these among them)",
    ),
    "bash scripts/cluster.sh down": Entry(
        dry="bash -n {repo}/scripts/cluster.sh",
        slow=False,
        why="would stop the cluster the cluster tests run on: `make test-cluster` runs it after them",
    ),
}

# Each YAML block of the docs (by its first line) and the test that writes it where the docs say
# and runs it; a block without an entry fails make test.
YAML_BLOCKS = {
    "rules:": "tests/test_recipe.py::test_every_recipe_file_in_the_docs_loads_and_runs_as_they_say",
}
