#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: ruff, unit tests, and every notebook through nbval.
#   bash scripts/test.sh            # from the repository root; extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PY="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate

# torch first and pinned: where pip can find the CPU build (our CI machines have it on local disk) this keeps
# the suite off the multi-GB CUDA build. Then the rest; requirements.txt's torch>=2.4 is already satisfied.
if ! python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  pip install -q "torch==$TORCH_VERSION"
fi
pip install -q -r requirements.txt
pip install -q --no-deps -e .
python -c "import torch; print(f'torch {torch.__version__} (CUDA build: {torch.version.cuda or \"no\"}), {torch.get_num_threads()} threads')"

ruff check .

# nbval compares against the stored CPU outputs, so the suite runs on CPU even on a GPU machine;
# scripts/gpu_check.py covers CUDA.
export CUDA_VISIBLE_DEVICES=""
export PYDEVD_DISABLE_FILE_VALIDATION=1
export MPLBACKEND=Agg
python -m pytest -q \
  --nbval --nbval-current-env --nbval-sanitize-with notebooks/nbval_sanitize.cfg \
  tests notebooks "$@"
