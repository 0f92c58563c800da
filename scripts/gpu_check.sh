#!/usr/bin/env bash
# The GPU check: what CI (CPU-only) cannot run. On a machine with an NVIDIA GPU, from the repo root:
#   bash scripts/gpu_check.sh [OUT_DIR]        (about 8 minutes on one H200)
# 1. the gpu-marked tests (every mode on CUDA; the optimizer step never syncs with the GPU);
# 2. bert_base in fp32, tf32, fp16, bf16, fp8 and bf16_true with torch.compile, side by side:
#    samples/s, speedup, peak memory and MFU per precision, in OUT_DIR/sweep/compare.md; gpt2 in
#    bf16, fp8 and bf16_true in OUT_DIR/gpt2/compare.md (fp8 needs torchao and an sm_89+ GPU);
# 3. the projection checked: the same configs eager with runner.project=[this GPU], projected
#    against measured step time per precision (OUT_DIR/projected-*.md);
# 4. with 2 or more GPUs, DDP and FSDP2 over NCCL on all of them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${1:-gpu-check}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 WANDB_MODE=offline AMP_RUNNER_CACHE="$OUT/cache" PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/gpus.txt"
$PY -m runner.doctor | tee "$OUT/doctor.txt"
$PY -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/tests.txt"
BERT_BASE=(model=bert_base dataset.batch_size=32 dataset.seq_len=512 dataset.num_documents=4000
  trainer.device=cuda trainer.compile=true trainer.max_steps=120 trainer.benchmark.warmup_steps=40
  trainer.val_check_interval=0 trainer.progress_bar=false logger=none)
$PY -m runner -m precision=fp32,tf32,fp16,bf16,fp8,bf16_true "${BERT_BASE[@]}" \
  "hydra.sweep.dir=$OUT/sweep" 2>&1 | tee "$OUT/sweep.txt"
cat "$OUT/sweep/compare.md"
GPT2=(model=gpt2 dataset.batch_size=16 dataset.seq_len=1024 dataset.num_documents=4000
  trainer.device=cuda trainer.compile=true trainer.max_steps=120 trainer.benchmark.warmup_steps=40
  trainer.val_check_interval=0 trainer.progress_bar=false logger=none)
$PY -m runner -m precision=fp32,bf16,fp8,bf16_true "${GPT2[@]}" "hydra.sweep.dir=$OUT/gpt2" \
  2>&1 | tee "$OUT/gpt2.txt"
cat "$OUT/gpt2/compare.md"
# 3. the projection (issue 33) against the real thing: the bert_base and gpt2 configs again,
#    eager (the projection models eager kernels, no fusion), each job projected on this GPU;
#    projected against measured step time per precision, to correct the achievable fractions.
MODEL=$($PY -c "import torch; from runner.measure.peaks import device_model; print(device_model(torch.cuda.get_device_name()) or '')")
if [ -n "$MODEL" ]; then
  $PY -m runner -m precision=fp32,bf16,fp8 "${BERT_BASE[@]}" trainer.compile=false \
    "runner.project=[$MODEL]" "hydra.sweep.dir=$OUT/projected-bert" 2>&1 | tee "$OUT/projected-bert.txt"
  $PY scripts/projection_check.py "$OUT/projected-bert" | tee "$OUT/projected-bert.md"
  $PY -m runner -m precision=fp32,bf16,fp8 "${GPT2[@]}" trainer.compile=false \
    "runner.project=[$MODEL]" "hydra.sweep.dir=$OUT/projected-gpt2" 2>&1 | tee "$OUT/projected-gpt2.txt"
  $PY scripts/projection_check.py "$OUT/projected-gpt2" | tee "$OUT/projected-gpt2.md"
else
  echo "projection check skipped: $(nvidia-smi -L | head -1) is not in the peak table" | tee "$OUT/projected.md"
fi
gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -ge 2 ]; then
  for strategy in ddp fsdp; do
    $PY -m torch.distributed.run --nproc_per_node="$gpus" -m runner "${BERT_BASE[@]}" \
      precision=bf16 trainer.max_steps=60 trainer.strategy=$strategy "hydra.run.dir=$OUT/$strategy" \
      2>&1 | tee "$OUT/$strategy.txt"
  done
fi
