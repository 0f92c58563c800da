#!/usr/bin/env bash
# The GPU check: what CI (CPU-only) cannot run, in one call on a machine with an NVIDIA GPU and
# no network, from the repo root with the wheel folder of scripts/gpu_wheels.sh beside it:
#   bash scripts/gpu_check.sh [RESULTS]     (RESULTS default $OUT, else gpu-check/)
# Each step runs under `timeout` inside one budget (GPU_CHECK_BUDGET, 570 s): the check ends
# inside 10 minutes on one H200. A failed or timed-out step is recorded and the next one runs;
# the exit status is 0 only where every step passed.
#  1. install: the wheel folder with `pip install --no-index`, the GPU image's torch pinned;
#  2. env: nvidia-smi and runner.doctor;
#  3. tests: the gpu-marked tests (tests/test_gpu.py, test_gpu_paths.py, test_max_batch.py);
#  4. bert: bert_base in fp32, tf32, fp16, bf16, fp8 and bf16_true, eager, each job also
#     projected on this GPU (runner.project): samples/s, speedup, peak memory, MFU;
#  5. gpt2: gpt2 in bf16 and fp8 with torch.compile (fp8 needs an sm_89+ GPU; two compiles of
#     GPT-2 are what fits the budget);
#  6. projection: bert's projected against measured step time (scripts/projection_check.py);
#  7. ddp, fsdp: with 2 or more GPUs, bert_base in bf16 over NCCL on all of them.
# RESULTS gets at most 8 files, no folders (what the device machine returns): check.log (every
# step's output), table.md (the table printed at the end), compare-bert.md, compare-gpt2.md,
# compare-bert.png, projection.md and summaries.json.gz (every job's summary.json).
#   GPU_WHEELS        the wheel folder (default gpu-wheels)
#   GPU_CHECK_DRY=1   every step on this CPU at tiny sizes, into a fresh venv (GPU_CHECK_PYTHON,
#                     default python3) holding torch (GPU_CHECK_TORCH, default torch==2.13.0) and
#                     the image's other packages, installed the ordinary way (constrained by
#                     GPU_CHECK_IMAGE_PINS where set), then the same --no-index install; the
#                     projection is for GPU_CHECK_PROJECT (default "H200 SXM"); ddp and fsdp run
#                     on 2 CPU ranks
#   GPU_CHECK_WORK    where sweeps, caches and checkpoints go (default a new temporary folder)
set -uo pipefail # no -e: a step that fails is recorded, and the check goes on
cd "$(dirname "$0")/.."
RESULTS=${1:-${OUT:-gpu-check}}
WHEELS=${GPU_WHEELS:-gpu-wheels}
DRY=${GPU_CHECK_DRY:-0}
BUDGET=${GPU_CHECK_BUDGET:-570}
WORK=${GPU_CHECK_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")}
if [ ! -d "$WHEELS" ]; then
  echo "no wheel folder $WHEELS: run scripts/gpu_wheels.sh where PyPI is, and carry it" >&2
  exit 2
fi
mkdir -p "$RESULTS" "$WORK"
RESULTS=$(cd "$RESULTS" && pwd) WORK=$(cd "$WORK" && pwd) WHEELS=$(cd "$WHEELS" && pwd) || exit 2
LOG=$RESULTS/check.log STEPS=$WORK/steps.tsv
: >"$LOG"
: >"$STEPS"
DEADLINE=$(($(date +%s) + BUDGET))
RESERVE=20 # seconds kept for the table at the end
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled MPLBACKEND=Agg
export AMP_RUNNER_CACHE=$WORK/cache PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1

say() { echo "$*" | tee -a "$LOG"; }

# step NAME LIMIT COMMAND...: COMMAND under `timeout` (LIMIT seconds, less where the budget ends
# sooner), its output into the log; the result goes to $STEPS (name, result, seconds).
step() {
  local name=$1 limit=$2 start rc result
  shift 2
  local left=$((DEADLINE - $(date +%s) - RESERVE))
  if [ "$left" -lt 10 ]; then
    printf '%s\tnot run: the budget was spent\t0\n' "$name" >>"$STEPS"
    say "=== $name: not run, the budget was spent"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  say "=== $name (at most ${limit} s): $*"
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) result=passed ;;
    124 | 137) result="timed out after ${limit} s" ;;
    *) result="failed (exit $rc)" ;;
  esac
  printf '%s\t%s\t%s\n' "$name" "$result" "$(($(date +%s) - start))" >>"$STEPS"
  say "=== $name: $result"
}

skip() { # skip NAME WHY: a step that does not apply here (neither passed nor failed)
  printf '%s\tskipped: %s\t0\n' "$1" "$2" >>"$STEPS"
  say "=== $1: skipped, $2"
}

if [ "$DRY" = 1 ]; then
  # The image, imitated: a fresh venv with torch, transformers and the other packages the GPU
  # image has (device notes), installed the ordinary way; the rest comes from $WHEELS below.
  say "=== dry run on this CPU: a fresh venv in $WORK/venv"
  "${GPU_CHECK_PYTHON:-python3}" -m venv "$WORK/venv" || exit 2
  PY=$WORK/venv/bin/python
  PINS=()
  [ -n "${GPU_CHECK_IMAGE_PINS:-}" ] && PINS=(-c "$GPU_CHECK_IMAGE_PINS")
  "$PY" -m pip install --quiet "${PINS[@]}" "${GPU_CHECK_TORCH:-torch==2.13.0}" transformers \
    numpy pandas pyarrow matplotlib rich pyyaml xxhash aiohttp pytest 2>&1 |
    grep -v "is ignored: it is neither" | tee -a "$LOG" # (this machine's pip index noise)
  [ "${PIPESTATUS[0]}" = 0 ] || { say "the image could not be imitated"; exit 2; }
  DEVICE=cpu GPUS=2 MODEL=${GPU_CHECK_PROJECT:-H200 SXM}
  SIZE=(model.hidden_size=32 model.num_hidden_layers=1 model.num_attention_heads=2
    model.intermediate_size=64 dataset.vocab_size=512 dataset.batch_size=8 dataset.seq_len=32
    dataset.num_documents=200 trainer.max_steps=4 trainer.benchmark.warmup_steps=1)
  BERT_SIZE=("${SIZE[@]}")
  GPT2_SIZE=(model.n_embd=32 model.n_layer=1 model.n_head=2 model.n_positions=64
    dataset.vocab_size=512 dataset.batch_size=8 dataset.seq_len=32 dataset.num_documents=200
    trainer.max_steps=4 trainer.benchmark.warmup_steps=1 trainer.compile=false)
  DIST_STEPS=4
else
  PY=${PY:-python3}
  DEVICE=cuda GPUS=$(nvidia-smi -L | grep -c '^GPU')
  MODEL="" # this GPU's datasheet model, once the install gives runner.measure.peaks
  BERT_SIZE=(dataset.batch_size=32 dataset.seq_len=512 dataset.num_documents=4000
    trainer.max_steps=60 trainer.benchmark.warmup_steps=20)
  GPT2_SIZE=(dataset.batch_size=16 dataset.seq_len=1024 dataset.num_documents=4000
    trainer.max_steps=50 trainer.benchmark.warmup_steps=20 trainer.compile=true)
  DIST_STEPS=40
fi
COMMON=(trainer.device=$DEVICE trainer.val_check_interval=0 trainer.progress_bar=false logger=none)
BERT=(model=bert_base "${BERT_SIZE[@]}" trainer.compile=false "${COMMON[@]}")
GPT2=(model=gpt2 "${GPT2_SIZE[@]}" "${COMMON[@]}")
BERT_MODES=fp32,tf32,fp16,bf16,fp8,bf16_true GPT2_MODES=bf16,fp8

# 1. Nothing may replace the image's torch: every install is constrained to it.
"$PY" -c 'import torch; print("torch==" + torch.__version__)' >"$WORK/torch-pin.txt"
# What the image has is kept (pip upgrades only where a requirement needs it); the rest comes
# from $WHEELS alone (--no-index). The commands are echoed (set -x) into the log.
# No pip configuration either: the folder and nothing else (here the configuration names others).
PIP_CONFIG_FILE=/dev/null step install 90 bash -c 'set -ex
  pip=("$1" -m pip install --no-index --find-links "$2" -c "$3")
  "${pip[@]}" "hydra-core>=1.3" "omegaconf>=2.3" "datasets>=2.19" torchao==0.18.0 "pytest>=8" \
    pytest-codeblocks==0.18.0  # tests/docs: the gpu blocks of the docs run in step 3
  "${pip[@]}" --no-deps -e .
  "$1" -m pip list | grep -Ei "^(torch|torchao|transformers|datasets|hydra-core|omegaconf|pyarrow) "
  ' install "$PY" "$WHEELS" "$WORK/torch-pin.txt"

# 2. The machine as the runner sees it
if [ "$DRY" = 1 ]; then
  step env 45 "$PY" -m runner.doctor
else
  step env 45 bash -c "nvidia-smi; $PY -m runner.doctor"
  MODEL=$("$PY" -c "import torch; from runner.measure.peaks import device_model
print(device_model(torch.cuda.get_device_name()) or '')" 2>>"$LOG")
fi
PROJECT=()
[ -n "$MODEL" ] && PROJECT=("runner.project=['$MODEL']")

# 3. The gpu-marked tests (skipped on a CPU: the dry run checks they collect and run)
mapfile -t GPU_TESTS < <(grep -rlE "pytest\.mark\.gpu" tests --include='test_*.py' | sort)
step tests 200 "$PY" -m pytest -q -p no:cacheprovider -m gpu "${GPU_TESTS[@]}"

# 4.-5. The sweeps; each writes its comparison (compare.md, .json, .png) in its folder
step bert 160 "$PY" -m runner -m "precision=$BERT_MODES" "${BERT[@]}" "${PROJECT[@]}" \
  "hydra.sweep.dir=$WORK/bert"
step gpt2 130 "$PY" -m runner -m "precision=$GPT2_MODES" "${GPT2[@]}" "hydra.sweep.dir=$WORK/gpt2"

# 6. The projection (issue 33) against the real thing, per job of the bert sweep
if [ -n "$MODEL" ]; then
  step projection 30 bash -c 'set -o pipefail; "$1" scripts/projection_check.py "$2" | tee "$3"' \
    projection "$PY" "$WORK/bert" "$RESULTS/projection.md"
else
  skip projection "$(nvidia-smi -L | head -1) is not in the peak table (runner/measure/peaks.py)"
fi

# 7. Several GPUs (in the dry run: two CPU ranks over gloo)
DIST=()
for strategy in ddp fsdp; do
  if [ "$GPUS" -ge 2 ]; then
    step "$strategy" 75 "$PY" -m torch.distributed.run --nproc_per_node="$GPUS" -m runner \
      "${BERT[@]}" precision=bf16 trainer.max_steps=$DIST_STEPS trainer.strategy=$strategy \
      "hydra.run.dir=$WORK/$strategy"
    DIST+=("$strategy:$WORK/$strategy:bf16")
  else
    skip "$strategy" "one GPU"
  fi
done

# The table, and the files that come back
for sweep in bert gpt2; do
  [ -f "$WORK/$sweep/compare.md" ] && cp "$WORK/$sweep/compare.md" "$RESULTS/compare-$sweep.md"
done
[ -f "$WORK/bert/compare.png" ] && cp "$WORK/bert/compare.png" "$RESULTS/compare-bert.png"
"$PY" scripts/gpu_table.py --steps "$STEPS" --summaries "$RESULTS/summaries.json.gz" \
  "bert:$WORK/bert:$BERT_MODES" "gpt2:$WORK/gpt2:$GPT2_MODES" "${DIST[@]}" \
  >"$RESULTS/table.md" 2>>"$LOG"
table_rc=$?
tee -a "$LOG" <"$RESULTS/table.md"
say "results in $RESULTS: $(ls "$RESULTS" | tr '\n' ' ')"
exit $((table_rc != 0))
