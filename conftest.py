"""Loaded by every pytest run in this repository, the unit tests' and nbval's over notebooks/ alike.

The suite runs whole notebooks unattended (nbval, the Colab, Binder and browser paths, whose kernels inherit the
environment): an exercise whose prediction is left at None must not stop them. The variable is
``anatomy_helpers.ui.exercises.AUTORUN_ENV`` (not imported here: this file must not import torch before
tests/conftest.py has set OMP_WAIT_POLICY).
"""

import os

os.environ["ANATOMY_AUTORUN"] = "1"
