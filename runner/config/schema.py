"""Schemas of the runner-owned config groups (the checks Hydra's types cannot express are in
validation.py).

The schemas live in Hydra's ConfigStore as `base_config`, so a misspelt key or a value of the
wrong type fails at compose time with the key's name. Task-owned groups (model, dataset, optim)
are free-form YAML with `_target_`: `validate` checks the optimizer and schedule keys the runner
knows, and `runner.errors.building` turns the rest into one line when their constructor fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from runner.config.autopilot import AutopilotConfig

# bf16_true: how an update goes into a bf16 weight (runner/precision/bf16_true.py)
BF16_UPDATES = ("plain", "stochastic_rounding", "kahan")
CPU_KERNELS = ("auto", "fast", "native")  # precision.cpu_kernels
# precision.adapter_dtype: a fine-tune's adapters (model.peft) in fp32, or in the base's dtype
ADAPTER_DTYPES = ("fp32", "base")
# runner.eval_precisions: autocast in a dtype, or the model cast to it (runner/answers/inference.py)
EVAL_PRECISIONS = ("fp32", "bf16", "fp16", "fp16_cast", "bf16_cast")
ADAMW = "torch.optim.AdamW"  # optim=adamw; with optim.state_dtype or a bf16 update: runner's own
ADAMW8BIT = "torchao.optim.AdamW8bit"  # optim=adamw8bit
OWN_ADAMW_KEYS = {"_target_", "_partial_", "lr", "betas", "eps", "weight_decay", "fused", "foreach"}
SCHEDULE_DECAYS = ("cosine", "linear", "constant")
# runner.memory_budget_gb by a GPU's name: its memory in GB as its maker states it (≈ GiB: an
# H100's 80 GB shows as 79.6 GiB), so that a CPU can plan for it (runner/answers/max_batch.py).
GPU_MEMORY_GB = {
    "T4": 16,
    "V100-16": 16,
    "V100-32": 32,
    "A10": 24,
    "L4": 24,
    "RTX-3090": 24,
    "RTX-4090": 24,
    "A100-40": 40,
    "L40S": 48,
    "A100-80": 80,
    "H100": 80,
    "H100-NVL": 94,
    "H200": 141,
    "B200": 180,
}
# Left out of a device's memory for the budget: the CUDA context, library workspaces outside
# PyTorch's allocator, and fragmentation (reserved over allocated).
MEMORY_MARGIN = 0.10


@dataclass
class GradScalerConfig:
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    # Beyond GradScaler (DeepSpeed's and Megatron's, runner/precision/scaler.py); the defaults
    # are GradScaler's behaviour. Overflows before the scale backs off (1: every one):
    hysteresis: int = 1
    # A floor: an overflow at it stops the run (the scale collapsed); null: none.
    min_scale: float | None = None
    max_scale: float | None = None  # a cap on growth; null: none


@dataclass
class StageConfig:
    mode: str = "fp32"
    until_step: int | None = None  # runs the optimizer steps before this one; null: to the end


@dataclass
class KeepBf16Config:
    # The model's first and last blocks (Task.shard_units: the blocks FSDP shards and gradient
    # checkpointing recomputes) whose Linears stay bf16 (Megatron's --num-layers-at-start-in-bf16
    # and --num-layers-at-end-in-bf16).
    first: int = 0
    last: int = 0


@dataclass
class Fp8Config:
    recipe: str = "tensorwise"  # torchao's: tensorwise, rowwise, rowwise_with_gw_hp
    # Left in bf16: "first"/"last" (the first and last Linear) and fnmatch patterns on names.
    skip: list[str] = field(default_factory=lambda: ["first", "last"])
    min_features: int = 0  # a Linear with a dimension below this stays bf16
    all_gather: bool = False  # FSDP2: gather converted weights in fp8
    keep_bf16: KeepBf16Config = field(default_factory=KeepBf16Config)  # fp8 and mxfp8
    # A fine-tune's adapters (model.peft: LoRA's A and B) converted too; by default they stay in
    # autocast's bf16 (small GEMMs, and the only weights that train)
    convert_adapters: bool = False


@dataclass
class Fp4KeepBf16Config(KeepBf16Config):
    last: int = 1  # NVFP4's recipe keeps the last blocks in bf16 (arXiv 2509.25149)


@dataclass
class Fp4Config:
    """precision=nvfp4 and mxfp4 (conf/precision/nvfp4.yaml, mxfp4.yaml): the converting modes'
    chooser keys (as precision.fp8 has them for fp8 and mxfp8), and the recipe's switches
    (runner/precision/fp4.py)."""

    skip: list[str] = field(default_factory=lambda: ["first", "last"])
    min_features: int = 0
    keep_bf16: KeepBf16Config = field(default_factory=Fp4KeepBf16Config)
    convert_adapters: bool = False
    weight_2d: bool = True  # weights quantized once in 16×16 tiles: forward and dgrad see one W
    rht: bool = True  # a 16×16 random Hadamard transform of the weight gradient GEMM's inputs
    sr: bool = True  # gradients stochastically rounded into FP4


@dataclass
class PrecisionConfig:
    mode: str = "fp32"
    # mode=staged: the modes in force, in order, by optimizer step (conf/precision/staged.yaml).
    stages: list[StageConfig] = field(default_factory=list)
    grad_scaler: GradScalerConfig = field(default_factory=GradScalerConfig)
    # Run bf16/fp16/tf32 even where the device only emulates it (slow; the numbers mislead).
    allow_emulated: bool = False
    # CPU only: bf16/fp16 matmuls and convolutions in PyTorch's own kernels (native), or computed
    # from their bf16/fp16 inputs in fp32 and rounded (fast: the same numerics at fp32 speed);
    # auto: fast for a dtype the CPU has no units for (runner/precision/cpu_kernels.py).
    cpu_kernels: str = "auto"
    # Submodules (names as in model.named_modules(), e.g. model.cls) run with autocast off and
    # their inputs cast to fp32: for sensitive layers and ops that only support fp32. Or auto:
    # found before training by short runs (runner/answers/island_search.py). Any, not
    # list[str] (OmegaConf has no unions): validation allows a list of names or "auto".
    fp32_modules: Any = field(default_factory=list)
    # A language model's output projection (Task.output_head) as one more fp32 island, in every
    # mode: its logits, and so its loss, in fp32 (the train/inference log-prob gap's fix).
    fp32_head: bool = False
    # Norm layers beyond those recognised (runner/precision/norms.py), by class name or module
    # name (fnmatch patterns): their weights stay fp32 where a mode casts weights, FSDP gathers
    # them in fp32.
    norm_modules: list[str] = field(default_factory=list)
    # The dtype gradients are averaged over ranks in (DDP and FSDP): fp32, or bf16 (half the
    # traffic, rounded sums).
    reduce_dtype: str = "fp32"
    # precision=bf16_true (conf/precision/bf16_true.yaml): norm layers keep fp32 weights, and how
    # each update goes into a bf16 weight: plain (rounded to nearest: updates below half of
    # bf16's spacing are lost), stochastic_rounding, or kahan (a bf16 compensation buffer).
    keep_norms_fp32: bool = True
    update: str = "plain"  # read it as cfg["update"]: cfg.update is the mapping's method
    # model.peft's adapters where the mode casts the weights (bf16_true, fp16_master): fp32 (the
    # base in bf16/fp16, the adapters and their updates fp32), or base (its dtype; fp16_master
    # then steps fp32 masters of them). Mixed modes keep every weight fp32 (runner/precision/
    # adapters.py).
    adapter_dtype: str = "fp32"
    # Each matmul's measured error (runner/measure/matmul_error.py) on the audited step, and
    # every N optimizer steps where N > 0.
    error_every_n_steps: int = 0
    # Whether it is measured at all (on by default; its probe computes a block at a time, outside
    # the step's accounting: the step's peak memory, FLOPs and projection are its own).
    matmul_error: bool = True
    # A converting mode's recipe: a YAML file of rules, a glob on module or class names → a format
    # per direction (forward, input_grad, weight_grad), first match wins
    # (runner/precision/recipe.py; docs/precision-modes.md#recipes). Null: the shorthands only.
    recipe: str | None = None
    fp8: Fp8Config = field(default_factory=Fp8Config)  # precision=fp8 (conf/precision/fp8.yaml)
    fp4: Fp4Config = field(default_factory=Fp4Config)  # precision=nvfp4, mxfp4
    # Each converted Linear's format chosen during the run (runner/precision/autopilot.py)
    autopilot: AutopilotConfig = field(default_factory=AutopilotConfig)


@dataclass
class BenchmarkConfig:
    # Steps left out of the speed figures (allocator, kernel selection, caches warming up).
    warmup_steps: int = 10


@dataclass
class TrainerConfig:
    max_steps: int = 300
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = 1.0
    gradient_clip_algorithm: str = "norm"
    # Several optimizers (a GAN): clip each one's gradients by their own norm, not all together.
    gradient_clip_per_group: bool = True
    log_every_n_steps: int = 10
    val_check_interval: int = 100
    limit_val_batches: int = 10  # 0: no evaluation
    checkpoint_every_n_steps: int = 0
    keep_last_k: int = 3  # step-N.pt files kept (last.pt always)
    resume: str | None = None  # null | auto | path/to/checkpoint.pt
    # When the job must be gone: auto = SLURM's end time where the job has one; N = N seconds
    # after the run started; null = neither (its signals alone stop it). The run checkpoints and
    # asks for the requeue early enough for its steps and checkpoint (runner/train/deadline.py),
    # keeping time_limit_margin_s after the checkpoint for the exit (W&B, submitit's requeue).
    time_limit_s: Any = "auto"
    time_limit_margin_s: float = 15.0
    # A checkpoint from another precision mode: refused, or converted for this one (and said so).
    resume_across_precision: bool = False
    max_consecutive_nonfinite: int = 25  # skipped/non-finite steps in a row before the run stops
    device: str = "auto"
    # torch's CPU threads: null = those of the cores this process may use that other processes
    # leave free (runner/train/threads.py); N = N threads.
    cpu_threads: int | None = None
    # With several ranks (torchrun): ddp (replicated weights) or fsdp (FSDP2, sharded weights).
    strategy: str = "ddp"
    compile: bool = False  # torch.compile the task's forward and loss (the backward follows)
    progress_bar: bool = True
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)


@dataclass
class LoggerConfig:
    backend: str = "wandb"  # wandb | none (metrics.jsonl and summary.json are written either way)
    project: str = "amp-runner"
    entity: str | None = None
    mode: str = "offline"  # offline | online | disabled; WANDB_MODE in the environment wins
    group: str | None = None  # null: the sweep's name in a multirun, none for a single run
    name: str | None = None  # null: the model and the overrides that differ, e.g. bert-bf16
    job_type: str = "train"
    tags: list[str] = field(default_factory=list)
    init_timeout_s: float = 30.0


AUTO_SEEDS = 3  # runner.seeds=auto: the seeds every row runs before the first look


@dataclass
class RunnerConfig:
    # A multirun runs each job with seeds seed..seed+N-1 (loss gaps against seed noise); auto:
    # 3 seeds, then one more at a time for the rows still undecided, up to max_seeds
    # (runner/compare/seeds.py).
    seeds: Any = 1
    max_seeds: int = 6
    speed: str = "jobs"  # or interleaved: each group's precisions timed again (interleave.py)
    speed_rounds: int = 3  # interleaved: rounds alternating the order (median, IQR over them)
    speed_steps: int = 5  # interleaved: timed steps per precision and round, after 2 untimed
    # After training, the final weights evaluated in each of these (EVAL_PRECISIONS; fp32, the
    # reference, always): the metrics' change and the outputs' gap (runner/answers/inference.py).
    eval_precisions: list[str] = field(default_factory=list)
    # The fp32 islands search (python -m runner.islands, precision.fp32_modules=auto): at most
    # this many modules kept fp32, and each trial run the first islands_steps optimizer steps.
    islands_max: int = 4
    islands_steps: int = 50
    # The recipe search (python -m runner.recipe): at most recipe_max module × direction units
    # kept in bf16, each verification run the first recipe_steps optimizer steps; its bf16
    # reference on recipe_seeds seeds (seed, seed+1, ...), whose spread is the noise its verdicts
    # know (1: none measured).
    recipe_max: int = 6
    recipe_steps: int = 200
    recipe_seeds: int = 2
    # Before training, the largest per-device micro-batch (and, for token data, the longest
    # sequence) that fits memory_budget_gb, measured (runner/answers/max_batch.py); training then
    # runs as configured.
    max_batch: bool = False
    # GB (2**30 bytes), or a GPU's name in GPU_MEMORY_GB (its memory less MEMORY_MARGIN); null:
    # the CUDA device's memory less MEMORY_MARGIN. On a CPU it must be given.
    memory_budget_gb: Any = None
    # The table at the end of a run: short (what a person reads first; runner/console.py) or
    # full (every key of summary.json). summary.json holds everything either way.
    summary: str = "short"
    # The projection (runner/measure/projection.py): each precision's estimated step time,
    # tokens/s, MFU, speedups and max batch on these GPUs (names of GPU_PEAK_TFLOPS, H100 for
    # the SXM part, or "all"), from the audited step; never measured. project_precisions: more
    # precisions to audit one step of and project beside the run's own (fp32, bf16: speedups).
    project: Any = None
    project_precisions: list[str] = field(default_factory=list)


@dataclass
class CompareConfig:
    """The comparison's target (runner/compare/target.py): the value of target_metric each row
    is timed to; null: the baseline row's final value (mean over its seeds) loosened by the 2%
    tolerance. target_direction: lower | higher is better; null: lower for a loss, perplexity
    or error, higher for the rest (eval_accuracy)."""

    target: float | None = None
    target_metric: str = "eval_loss"
    target_direction: str | None = None
    # A loss gap to the baseline still counted as the same convergence (relative): the band the
    # loss verdict holds each interval against, and the default target's loosening.
    tolerance: float = 0.02


@dataclass
class Config:
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    model: Any = MISSING
    dataset: Any = MISSING
    optim: Any = MISSING
    seed: int = 0
    cache_dir: str = "~/.cache/amp-runner"


def register() -> None:
    ConfigStore.instance().store(name="base_config", node=Config)
