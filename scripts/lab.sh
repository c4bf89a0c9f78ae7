#!/usr/bin/env bash
# Set up .venv (once, then offline) and open the course in JupyterLab, on the learner notebooks (learner/).
#   bash scripts/lab.sh [--executed] [JUPYTER ARGS]   # --executed: the notebooks with their outputs (notebooks/)
# The work is done by scripts/course.py (the same on Windows: scripts\lab.cmd). PYTHON picks the interpreter;
# --here uses its environment instead of .venv/. exec, and course.py execs JupyterLab: Ctrl+C or SIGTERM to this
# script's process reach the server itself. JupyterLab and its kernels get OMP_WAIT_POLICY=PASSIVE unless it is set
# (torch's OpenMP threads sleep instead of spinning while they wait: much faster on a busy laptop).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/course.py lab "$@"
