#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh installs on the GPU machine, which has no network. Run here,
# where PyPI is reachable, from the repo root:
#   bash scripts/gpu_wheels.sh [DIR]      (DIR default gpu-wheels/, git-ignored; about 7 MB)
# then carry DIR to the GPU machine with the working tree (docs/testing.md, "The GPU check").
#   GPU_PY_VERSION  the Python the wheels are for: 3.12 (default, the GPU image's) or 3.11 (the
#                   CPU dry run, GPU_CHECK_DRY=1, on this machine's Python)
#   PY              the Python whose pip downloads (default python3)
#
# The GPU image (Python 3.12, torch 2.11.0+cu130, transformers, numpy, pandas, pyarrow, rich,
# matplotlib, peft, pytest: the device notes' package list of 2026-11-17) lacks what is below and
# nothing else the check imports. Each is fetched with --no-deps at the version this project is
# tested with, so no torch, nvidia-*, triton or numpy wheel is ever fetched (checked at the end),
# and the install there (`pip install --no-index`) keeps every package the image already has.
# Left out on purpose: wandb (the check runs logger=none), the Hydra joblib/submitit launchers
# and submitit (no cluster there), pytest-xdist (the GPU tests run in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-gpu-wheels}
PYV=${GPU_PY_VERSION:-3.12}
PY=${PY:-python3}
ABI="cp${PYV/./}"

# torchao 0.18.0 for torch 2.11: torchao is ABI-stable from 0.17.0 on and needs torch >= 2.11
# (torchao's compatibility table, pytorch/ao issue #2919: "0.17.0 | 2.11.0+"; pytorch/ao PR #4154
# removed the table for that reason); 0.18.0 dropped only torch < 2.11 (its v0.18.0 release
# notes). 0.18 is the release runner/precision/mxfp8.py is written against (MXFP8Linear), and
# float8 training (precision=fp8) is pure Python over torch._scaled_mm, which torch 2.11 has.
WHEELS=(
  hydra-core==1.3.8 omegaconf==2.3.1
  # datasets 5.2.0 wants pyarrow >= 24; 5.0.0 beside it (pyarrow >= 21, fsspec <= 2026.4.0) is
  # what pip falls back to if the image's pyarrow is older. fsspec: both releases' upper bounds.
  datasets==5.2.0 datasets==5.0.0 dill==0.4.1 multiprocess==0.70.19
  fsspec==2026.9.0 fsspec==2026.4.0
  torchao==0.18.0
  # pytest where the image had none (the image's is kept if it has one)
  pytest==8.4.2 pluggy==1.7.0 iniconfig==2.3.1
  # the docs' gpu-marked blocks (tests/docs/test_docs_commands.py) are found by it
  pytest-codeblocks==0.18.0
  # `pip install --no-index -e .` builds the project in an isolated env from this folder
  setuptools==84.2.1
)
# antlr4-python3-runtime (omegaconf's parser) is published as an sdist only: built here into a
# pure-Python wheel, which any Python 3 installs.
ANTLR=antlr4-python3-runtime==4.9.3

SPEC="python $PYV: ${WHEELS[*]} $ANTLR"
if [ -f "$DIR/.spec" ] && [ "$(cat "$DIR/.spec")" = "$SPEC" ]; then
  echo "gpu wheels up to date in $DIR ($(du -sh "$DIR" | cut -f1))"
  exit 0
fi
mkdir -p "$DIR"
rm -f "$DIR"/*.whl "$DIR/.spec"
PIP=("$PY" -m pip --disable-pip-version-check)
"${PIP[@]}" wheel --quiet --no-deps -w "$DIR" "$ANTLR"
for wheel in "${WHEELS[@]}"; do  # one at a time: two releases of one package are asked for
  "${PIP[@]}" download --quiet --no-deps --only-binary=:all: -d "$DIR" \
    --python-version "$PYV" --implementation cp --abi "$ABI" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any "$wheel"
done
if found=$(ls "$DIR" | grep -Ei '^(torch|nvidia|triton|cuda|numpy)[-_]'); then
  echo "error: $DIR holds a wheel the GPU image has, which would replace it: $found" >&2
  exit 1
fi
echo "$SPEC" >"$DIR/.spec"
echo "gpu wheels for Python $PYV in $DIR: $(ls "$DIR"/*.whl | wc -l) files," \
  "$(du -sh "$DIR" | cut -f1)"
