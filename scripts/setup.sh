#!/usr/bin/env bash
# Create .venv and install amp-runner with its dev tools. Idempotent: a second run is quick.
#   TORCH_SPEC  the torch requirement to install first (default: the CPU build torch==2.13.0 on
#               machines without an NVIDIA GPU; the project's own range `torch>=2.6` otherwise)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if [ -z "${TORCH_SPEC:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1; then TORCH_SPEC="torch>=2.6"; else TORCH_SPEC="torch==2.13.0"; fi
  fi
  echo "installing $TORCH_SPEC"
  "${PIP[@]}" "$TORCH_SPEC"
fi
"${PIP[@]}" -e ".[dev]"
echo "ready: $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)')"
