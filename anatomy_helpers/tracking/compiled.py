"""``torch.compile``d code in a watched step: found and refused, never measured as if it were eager.

The tracker sees memory through a dispatch mode, which sees the eager ops torch dispatches one by one. Code that
``torch.compile`` (Dynamo, then inductor) compiled runs something else: fused kernels whose intermediates never
exist as tensors, so its memory is not the eager step's (lesson 10 measures one with torch.profiler: a compiled
step can peak at half the eager one). Under a dispatch mode Dynamo does not compile the model's code (it runs it
eagerly), but it does try to compile the mode's own ``__torch_dispatch__``, whose stack of modes is empty while it
runs: with real tensors that recompiles it until Dynamo's limit, with a dry run's fake tensors inductor's code reads
storages that hold no data and the process dies of a segmentation fault. So:

* :func:`compiled_modules` finds compiled modules before anything runs: ``torch.compile(module)`` (an
  ``OptimizedModule``) or ``module.compile()`` (which sets ``_compiled_call_impl``), the model or any submodule;
* :func:`refuse_compiled_code` finds compiled functions as they are called: inside it, the first frame Dynamo would
  compile (one holding a tensor, in code that ``torch.compile`` wrapped) raises instead, before any of its ops runs
  (Dynamo's ``fail_on_recompile`` stance, which refuses every compilation that is not cached: under a dispatch
  mode none is), and :func:`compiled_function` names it; the tracker turns that into :class:`CompiledCodeError`.
"""

from __future__ import annotations

import contextlib
import re
import sys

import torch.nn as nn

from ..core.tensors import SPARSE_GRADIENT_REASON, sparse_gradient_modules

#: Why a tracked step refuses compiled code (the dry run says why it refuses in its own words).
TRACKER_REASON = (
    "the tracker sees the eager ops torch dispatches one by one, not the fused kernels torch.compile makes (under "
    "the tracker Dynamo would run the code eagerly, so the trace would be the eager step's memory); measure a "
    "compiled step with torch.profiler's memory timeline (lesson 10's compile_memory), or track the model "
    "uncompiled"
)

# Dynamo's message under the fail_on_recompile stance (torch/_dynamo/eval_frame.py, _callback_from_stance)
_DYNAMO_REFUSAL = re.compile(
    r"stance is 'fail_on_recompile'\. filename: '(?P<file>[^']*)', function name: '(?P<name>[^']*)', "
    r"line number: (?P<line>\d+)"
)


class CompiledCodeError(ValueError):
    """``torch.compile``d code met where a step is watched; ``where``: the module or function, named."""

    def __init__(self, where: str, reason: str = TRACKER_REASON):
        super().__init__(f"{where} is compiled by torch.compile, so it is refused: {reason}")
        self.where = where


def compiled_modules(model: nn.Module) -> list[str]:
    """``model``'s compiled modules, each named with its class and how it was compiled ("the model" for ``model``
    itself), in ``named_modules`` order.

    A module is compiled when it is an ``OptimizedModule`` (``torch.compile(module)``; its own modules are those of
    the module it wraps, found too) or when ``module.compile()`` set its ``_compiled_call_impl``.
    """
    if _dynamo() is None:
        return []
    from torch._dynamo.eval_frame import OptimizedModule  # Dynamo is imported already (_dynamo)

    found = []
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, OptimizedModule):
            found.append(f"{name or 'the model'} ({type(module._orig_mod).__name__}, by torch.compile(module))")
        elif getattr(module, "_compiled_call_impl", None) is not None:
            found.append(f"{name or 'the model'} ({type(module).__name__}, by module.compile())")
    return list(dict.fromkeys(found))


def refuse_untrackable(model: nn.Module) -> None:
    """Refuse, before anything runs, a model the tracker cannot count: compiled code (:class:`CompiledCodeError`)
    or a module that gets a sparse gradient (a ValueError: the tracker counts strided storages only)."""
    compiled = compiled_modules(model)
    if compiled:
        raise CompiledCodeError(", ".join(compiled))
    sparse = sparse_gradient_modules(model)
    if sparse:
        raise ValueError(
            f"{', '.join(sparse)} gets a sparse gradient, which the tracker cannot count: {SPARSE_GRADIENT_REASON}"
        )


def compiled_function(exc: BaseException) -> str | None:
    """The function ``exc`` says Dynamo refused to compile under :func:`refuse_compiled_code` ("name (file:line)"),
    or None when ``exc`` is anything else."""
    match = _DYNAMO_REFUSAL.search(str(exc)) if isinstance(exc, RuntimeError) else None
    return f"function {match['name']} ({match['file']}:{match['line']})" if match else None


def _dynamo():
    """torch._dynamo if this process imported it, else None. Importing it takes seconds, so the package never does:
    ``torch.compile`` (and so ``module.compile()``) imports it, and compiled code exists only once it was called."""
    return sys.modules.get("torch._dynamo")


@contextlib.contextmanager
def refuse_compiled_code():
    """Inside, a call into code ``torch.compile`` wrapped raises Dynamo's RuntimeError (:func:`compiled_function`
    names the function from it) before any of its ops runs; everything else runs as it would.

    Not seen: a function the block itself compiles, in a process that compiled nothing before it (:func:`_dynamo`).
    """
    dynamo = _dynamo()
    with dynamo.set_stance("fail_on_recompile") if dynamo is not None else contextlib.nullcontext():
        yield
