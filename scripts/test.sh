#!/usr/bin/env bash
# Set up .venv (once) and run the whole test suite: ruff, unit tests, every notebook through nbval, and the
# delivery tests (Colab path, Binder path, offline wheelhouse, widgets in a real browser).
#   bash scripts/test.sh            # from anywhere; extra arguments go to pytest
#   bash scripts/test.sh --quick    # ruff and the unit tests only: no notebooks, no delivery tests (while you work)
# The work is done by scripts/course.py (the same on Windows: scripts\test.cmd). PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/course.py test "$@"
