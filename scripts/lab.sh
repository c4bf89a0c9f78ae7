#!/usr/bin/env bash
# Set up (if needed) and open the course in JupyterLab.
#   bash scripts/lab.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# Keep a torch that is already installed (CPU or CUDA); otherwise install the pinned release.
python -c "import torch" 2>/dev/null || pip install -q "torch==${TORCH_VERSION:-2.13.0}"
pip install -q -r requirements.txt
pip install -q --no-deps -e .
extra=()
[ "$(id -u)" = 0 ] && extra+=(--allow-root)  # containers and CI run as root
exec jupyter lab notebooks/ "${extra[@]}" "$@"
