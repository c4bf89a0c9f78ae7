"""Ctrl-C anywhere in a tracked step or a dry run: raised at a safe point, nothing left behind, no abort.

Each test runs a child Python process whose timer thread sends SIGINT to it at random moments while it tracks
(or dry-runs) training steps in a loop, many times; after every trial the child checks that nothing of the tracker
is left (no running tracker, no dispatch mode, no profiler session, the SIGINT handler back) and, at the end, that
a tracker still records. An abort (torch's "terminate called") would end the child with a signal instead.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from anatomy_helpers import make_model, make_optimizer, track_steps
from anatomy_helpers.core.interrupts import DeferredInterrupt
from anatomy_helpers.tracking.tracker import StepTracker

from .conftest import SMALL

CHILD = textwrap.dedent(
    r"""
    import os, random, signal, sys, threading, time
    # Python's own Ctrl-C handler, as in a terminal or a notebook (a shell that starts a job in the background
    # hands it SIGINT ignored, and the tracker then leaves that choice alone)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import torch
    from torch._C._autograd import _profiler_enabled
    from anatomy_helpers import make_model, make_optimizer, track_steps
    from anatomy_helpers.prediction.dryrun import dry_run_config
    from anatomy_helpers.tracking.tracker import StepTracker

    torch.set_num_threads(1)
    what, trials = sys.argv[1], int(sys.argv[2])
    small = dict(n_layer=2, d_model=64, n_head=2, seq_len=32)
    model = make_model(device="cpu", **small)
    opt = make_optimizer(model, "adamw")

    def run():
        if what == "track":
            track_steps(model, opt, steps=1, batch_size=4)
        else:
            dry_run_config(n_layer=2, d_model=64, n_head=2, seq_len=32, batch_size=4, steps=1)

    times = []
    for _ in range(3):  # how long one uninterrupted run takes, once warm
        start = time.perf_counter(); run(); times.append(time.perf_counter() - start)
    duration = min(times)
    rng = random.Random(0)
    interrupted = 0
    for _ in range(trials):
        timer = threading.Timer(rng.uniform(0, duration), os.kill, (os.getpid(), signal.SIGINT))
        try:
            timer.start()
            run()
        except KeyboardInterrupt:
            interrupted += 1
        while True:  # a signal that comes after the run lands here, outside any tracker
            try:
                timer.join()
                time.sleep(0.005)
                break
            except KeyboardInterrupt:
                pass
        assert StepTracker._running is None, "a tracker is still marked running"
        assert not hasattr(model, "_anatomy_tracker"), "the model still points at a tracker"
        assert torch._C._len_torch_dispatch_stack() == 0, "a dispatch mode is left on"
        assert not _profiler_enabled(), "a profiler session is left on"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "SIGINT handler not restored"
    run()  # still works afterwards
    print(f"ok {interrupted} of {trials} interrupted")
    """
)


def _run_child(what: str, trials: int) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, what, str(trials)], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, f"child ended with {done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}"
    assert "Exception ignored" not in done.stderr, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("what, trials", [("track", 60), ("dry", 40)])
def test_ctrl_c_at_random_moments_leaves_nothing_behind(what, trials):
    out = _run_child(what, trials)
    interrupted = int(out.split()[1])
    assert interrupted >= trials // 3, out  # most signals landed inside a run (the rest just after it)


@pytest.fixture(autouse=True)
def pythons_own_sigint_handler():
    """Python's default Ctrl-C handler for each test, whatever this process inherited (a shell that starts the
    suite in the background hands it SIGINT ignored, which DeferredInterrupt rightly leaves alone)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_sigint_ignored_by_the_host_stays_ignored():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    deferred = DeferredInterrupt()
    deferred.start()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    deferred.stop()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and not deferred.pending


def test_deferred_interrupt_raises_at_check_and_restores_the_handler():
    deferred = DeferredInterrupt()
    deferred.start()
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    os.kill(os.getpid(), signal.SIGINT)  # noted, not raised
    assert deferred.pending
    with pytest.raises(KeyboardInterrupt):
        deferred.check()
    deferred.check()  # raised once only
    deferred.stop()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_deferred_interrupt_pending_at_stop_is_raised_after_the_handler_is_back():
    deferred = DeferredInterrupt()
    deferred.start()
    os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        deferred.stop()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_users_own_sigint_handler_is_left_alone():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda *a: seen.append(1))
    try:
        deferred = DeferredInterrupt()
        deferred.start()
        os.kill(os.getpid(), signal.SIGINT)
        deferred.stop()
        assert seen == [1] and not deferred.pending
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_forward_from_another_thread_is_refused_not_merged():
    torch.manual_seed(0)
    model = make_model(device="cpu", **SMALL)
    opt = make_optimizer(model, "adamw")
    x = torch.zeros(1, SMALL["seq_len"], dtype=torch.long)
    errors = []

    def other_thread():
        try:
            with torch.no_grad():
                model(x)
        except RuntimeError as e:
            errors.append(str(e))

    def after_step(i):
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()

    trace = track_steps(model, opt, steps=3, batch_size=4, after_step=after_step)
    assert len(errors) == 3 and "another thread" in errors[0]
    assert trace.training_steps() == [1, 2, 3]  # the three steps of this thread, no more
    with torch.no_grad():
        model(x)  # after the block the model is free again, from any thread


def test_teardown_finishes_even_if_an_undo_is_interrupted():
    model = make_model(device="cpu", **SMALL)
    opt = make_optimizer(model, "adamw")
    tracker = StepTracker(model, opt)

    def interrupted_undo():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with tracker:
            tracker._undo.append(interrupted_undo)  # runs first at teardown: newest first
    assert StepTracker._running is None and not hasattr(model, "_anatomy_tracker")
    assert torch._C._len_torch_dispatch_stack() == 0
    assert tracker.trace is not None  # the trace was still built
