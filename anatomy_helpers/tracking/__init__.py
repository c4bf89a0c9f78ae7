"""Watching a real training step: the tracker and what it records.

* :mod:`.events` -- the vocabulary: memory categories, phases, model parts, the typed records of a trace;
* :mod:`.recorder` / :mod:`.tracker` -- :class:`~.tracker.StepTracker` sees every storage an op makes or frees
  (a ``TorchDispatchMode`` plus module and autograd hooks) and records it through :class:`~.recorder.Recorder`;
* :mod:`.scratch` -- memory a kernel takes and gives back inside one op (the allocator's own reports);
* :mod:`.trace` -- :class:`~.trace.Trace`, what a tracked run returns: timeline, peaks, phases, tables;
* :mod:`.profiler` -- torch.profiler's memory timeline read into a Trace, to check the tracker against.

This subpackage imports only the core's utilities (units, checks, tables, tensors, interrupts, checkpointing);
what runs steps inside a tracker (``train``, ``budget``, ``cuda``) sits above it.
"""
