"""The training step on several ranks: what each rank runs and tracks (:mod:`.ranks`), how a notebook or a test
starts a local world of ranks and reads their per-rank tables (:mod:`.world`; on Linux its ranks are forked from a
process that imported torch once, :mod:`.zygote`), and the command line
(``python -m anatomy_helpers.distributed``, :mod:`.__main__`). ``ranks`` never imports ``world``.
"""
