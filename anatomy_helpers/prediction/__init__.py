"""Predicting a step's memory before running it, from the cheapest guess to the exact answer.

* :mod:`.formulas` -- the published closed forms (parameter count, Korthikanti et al.'s activation terms);
* :mod:`.estimate` -- the course's closed form, byte-exact for the course GPT on CPU kernels;
* :mod:`.saved` -- what autograd really saved, grouped by the formula's terms (to test the formulas against);
* :mod:`.dryrun` / :mod:`.fake_check` -- the real step on tensors without data (FakeTensorMode), refused where a
  fake kernel's layout differs from the real one;
* :mod:`.allocator` / :mod:`.snapshot` -- the CUDA caching allocator's rules replayed over a trace;
* :mod:`.devices` / :mod:`.cuda_rules` / :mod:`.fit` / :mod:`.fixes` -- will it fit on a named GPU, and the
  cheapest change that makes it fit.
"""
