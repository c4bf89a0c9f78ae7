"""Loaded by every pytest run in this repository, the unit tests' and nbval's over notebooks/ alike.

The suite runs whole notebooks unattended (nbval, the Colab, Binder and browser paths, whose kernels inherit the
environment): an exercise whose prediction is left at None must not stop them. The variable is
``anatomy_helpers.ui.exercises.AUTORUN_ENV`` (not imported here: this file must not import torch before
tests/conftest.py has set OMP_WAIT_POLICY).

The op checks' cache on disk (``ANATOMY_CACHE_DIR``, anatomy_helpers/prediction/fake_check.py) is one directory per
run, under pytest's temporary base, shared by the xdist workers, the notebooks' kernels and the subprocesses they start
(all inherit the environment): each op signature is checked against its real kernel once per run, not once per
process, and never read from a developer's own cache or an earlier run. A value already set wins. Tests that count
real checks take the ``fresh_op_checks`` fixture (tests/conftest.py): an empty directory of their own.
"""

import os

import pytest

os.environ["ANATOMY_AUTORUN"] = "1"


@pytest.hookimpl(trylast=True)  # after pytest's tmp_path plugin has made its factory
def pytest_configure(config):
    factory = getattr(config, "_tmp_path_factory", None)
    if "ANATOMY_CACHE_DIR" not in os.environ and factory is not None:  # set: the caller's, or an xdist worker's
        os.environ["ANATOMY_CACHE_DIR"] = str(factory.getbasetemp() / "anatomy-cache")
