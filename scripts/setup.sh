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
# -qq: pip's errors only (a failed install still says why); this machine's pip configuration may
# name package indexes that are absent, and pip warns of each for every package it looks up.
PIP=("$VENV/bin/python" -m pip install -qq --disable-pip-version-check)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if [ -z "${TORCH_SPEC:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1; then TORCH_SPEC="torch>=2.6"; else TORCH_SPEC="torch==2.13.0"; fi
  fi
  echo "installing $TORCH_SPEC"
  # numpy with it: torch imported without numpy warns that it failed to initialize NumPy
  "${PIP[@]}" "$TORCH_SPEC" "numpy>=1.24"
fi
# Nothing installed after torch may replace it: were a release of peft or accelerate (model.peft)
# to ask for a newer torch, pip would upgrade it to the newest. So every later install is
# constrained to the torch just installed (it then fails, and says why, instead).
TORCH_PIN=$(mktemp)
trap 'rm -f "$TORCH_PIN"' EXIT
"$VENV/bin/python" -c 'import torch; print("torch==" + torch.__version__)' >"$TORCH_PIN"
# torchao (optim=adamw8bit, precision=fp8) is built for one torch release and is not a project
# dependency (`torchao>=0.18` could bring a torch of its own choosing): it is installed here pinned
# to the torch just installed, from torchao's table of compatible releases. Add a line when torch
# moves; other versions get no torchao, with a warning (those options then say it is missing).
TORCH_RELEASE=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
case "$TORCH_RELEASE" in
  2.13.*) TORCHAO=0.18.0 ;;
  *) TORCHAO="" ;;
esac
if [ -n "$TORCHAO" ]; then
  "${PIP[@]}" --no-deps "torchao==$TORCHAO"  # --no-deps: never a torch upgrade
else
  echo "warning: no known torchao release for torch $TORCH_RELEASE: optim=adamw8bit and precision=fp8 are unavailable" >&2
fi
"${PIP[@]}" -c "$TORCH_PIN" -e ".[dev]"  # peft among the project's dependencies
echo "ready: $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)')"
