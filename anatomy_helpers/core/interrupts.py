"""Ctrl-C at a safe point: defer SIGINT while torch or the tracker is in the middle of something.

A KeyboardInterrupt is raised by Python at whatever bytecode runs when the signal arrives. Inside a tracked step
that can be a weak-reference callback (Python prints "Exception ignored" and the Ctrl-C is lost), the middle of the
tracker's teardown (hooks left installed), or Python code that torch's C++ dispatcher called under a fake-tensor dry
run, where torch 2.13 cannot carry the exception back and aborts the process (``terminate called after throwing
pybind11::error_already_set``). :class:`DeferredInterrupt` replaces the SIGINT handler with one that only notes the
signal; :meth:`DeferredInterrupt.check` raises the KeyboardInterrupt where the caller knows it is safe (the tracker
calls it from its Python hooks: a module's forward, a gradient landing, the optimizer step; never from inside an
op, where a dry run's C++ caller would abort), and leaving the block restores the handler and raises a pending
interrupt. Only the main thread can handle signals: elsewhere the class does nothing.
"""

from __future__ import annotations

import signal
import threading


class _Held:
    """The one SIGINT deferral of the process (signals go to the main thread only): how many blocks hold it."""

    depth = 0
    pending = False
    previous = None


def _note(signum, frame) -> None:
    _Held.pending = True


class DeferredInterrupt:
    """Hold SIGINT between ``start()`` and ``stop()``; ``check()`` raises it at a safe point.

    ``start`` and ``stop`` are separate calls (not only a ``with`` block) so that the tracker can put them on its
    undo stack. Blocks nest (a dry run holds it, and the tracker inside it too): the handler goes back when the
    outermost one stops, and a check in any of them raises the one pending Ctrl-C.
    """

    def __init__(self) -> None:
        self._holding = False

    def start(self) -> None:
        """Defer SIGINT from now on (main thread only; elsewhere, or under a handler of the user's, a no-op)."""
        if self._holding or threading.current_thread() is not threading.main_thread():
            return
        if _Held.depth == 0:
            if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
                return  # the user (or a host program) installed their own handler: leave their choice alone
            _Held.previous = signal.signal(signal.SIGINT, _note)
            _Held.pending = False
        _Held.depth += 1
        self._holding = True

    @property
    def pending(self) -> bool:
        """Whether a Ctrl-C came in and waits to be raised."""
        return self._holding and _Held.pending

    def check(self) -> None:
        """Raise the KeyboardInterrupt that arrived while deferred, once."""
        if self._holding and _Held.pending:
            _Held.pending = False
            raise KeyboardInterrupt

    def stop(self) -> None:
        """Release this hold; the outermost one gives SIGINT back and raises a Ctrl-C that came in meanwhile."""
        if not self._holding:
            return
        self._holding = False
        _Held.depth -= 1
        if _Held.depth == 0:
            signal.signal(signal.SIGINT, _Held.previous)
            if _Held.pending:
                _Held.pending = False
                raise KeyboardInterrupt
