"""A will-it-fit answer: :class:`FitReport`, the phases' tensor peaks beside the simulated allocator's reserved
memory, the one verdict (the allocator decides), its margin against what is assumed, and the assumptions every
answer lists. Made by :mod:`anatomy_helpers.prediction.fit` (``fit_run``, ``trace_fit_report``) for the course GPT
and a Hugging Face fine-tune, one device or per rank; printed by lessons 06 and 09 and the CLI's ``predict``.

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.tables import Col, format_table
from ..core.units import pick_unit
from .allocator import LimitReplay
from .cuda_rules import CPU_RULES

#: Why the allocator's reserved memory, not the tensors, decides (a report's "decides" line).
RESERVED_DECIDES = (
    "decides: the allocator's reserved memory, not the tensors: PyTorch's caching allocator cudaMallocs segments and "
    "cuts tensors' blocks out of them; a freed block stays in its segment, where a larger tensor may not fit "
    "(fragmentation), so reserved runs above the tensors"
)
#: How a learner measures their own GPU (a report's last lines).
YOUR_CARD = (
    "your own GPU: torch.cuda.mem_get_info() returns its (free, total) bytes, free counted after this process's CUDA "
    "context and whatever else holds the card; compare free with the reserved peak above, or ask "
    'will_it_fit(..., device="this GPU"), which measures the context that way'
)
NEAR_THE_EDGE = (
    "near the edge: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before the process first uses CUDA) lets "
    "the allocator grow a segment instead of cudaMalloc-ing another, which reduces fragmentation: reserved comes "
    "closer to the tensors (the simulator here models the default allocator, not expandable segments)"
)


def assumed_bytes(context: int, context_measured: bool, workspace: int) -> int:
    """What a prediction assumes rather than measures (bytes): the CUDA context's allowance unless it was measured,
    and the cuBLAS workspaces it does not count (``workspace``)."""
    return (0 if context_measured else context) + workspace


def size_text(nbytes: int) -> str:
    """``nbytes`` in the unit that suits it: "114.97 MiB", "14.50 GiB"."""
    unit, scale = pick_unit(nbytes)
    return f"{nbytes / scale:,.2f} {unit}"


@dataclass(frozen=True)
class PhaseNeed:
    """One phase of one step: its peak of tensor bytes (by category, at the peak) and the simulated allocator."""

    step: int
    phase: str
    tensors: int  # the dry run's peak of live tensor bytes in the phase (the highest of a step's micro-batches)
    reserved: int  # the uncapped simulated allocator's reserved bytes at that peak (its cache included)
    breakdown: dict[str, int]  # bytes per category at the tensor peak


@dataclass(frozen=True)
class FitReport:
    """Whether two training steps fit on a device, phase by phase (bytes).

    The verdict comes from replaying the dry run's allocations through the caching-allocator simulator capped at
    the usable memory (``allocator.replay_with_limit``): it rounds, splits and caches as the real allocator does,
    and, like it, gives its cached free segments back and retries before it declares an out-of-memory error. So
    the allocator's reserved memory decides, not the tensors' peak (:data:`RESERVED_DECIDES`). ``close``: the
    simulated answer turns within ``allowance`` bytes of the usable memory (more for a step that does not fit,
    less for one that does): what is assumed, not measured (the CUDA context's allowance where it is assumed, the
    cuBLAS workspaces where CUDA's rules are not applied), so the verdict says it is too close to call.
    ``assumptions``: what the prediction takes as given about the step (sequences, checkpointing, precision), by
    the caller; the report adds the device's (:meth:`assumption_lines`).
    """

    label: str
    device: str  # the device's name
    capacity: int  # its total memory, as a process sees it (devices.Device.total)
    usable: int  # capacity - the CUDA context's share
    phases: tuple[PhaseNeed, ...]  # step 1 and step 2, forward / backward / optimizer, in time order
    failure: tuple[int, str] | None  # (step, phase) where the capped simulated allocator ran out, or None
    note: str = ""
    context_note: str = "CUDA context (assumed)"
    rules: str = CPU_RULES  # which device rules the phase needs follow (see cuda_rules.rules_text)
    assumptions: tuple[str, ...] = ()  # the step's assumptions, one line each
    workspace: int = 0  # cuBLAS workspace bytes not counted (0 where CUDA's rules add them)
    oom: LimitReplay | None = None  # the capped replay where it ran out: what it held and asked for
    close: bool = False  # the simulated answer turns within `allowance` bytes of the usable memory
    capacity_note: str = ""  # which total ``capacity`` is, in words (devices.Device.total_note)
    dry_run: str = ""  # which dry run answered, in words (fit.dry_run_text; "": its maker does not say)

    @property
    def fits(self) -> bool:
        return self.failure is None

    @property
    def context_assumed(self) -> bool:
        """True where the CUDA context's share is our allowance, not measured on the GPU."""
        return "assumed" in self.context_note

    @property
    def allowance(self) -> int:
        """Bytes assumed, not measured: the CUDA context's allowance (where it is assumed) and the cuBLAS
        workspaces not counted. Kernel scratch is not counted either, and has no size to add here."""
        return assumed_bytes(self.capacity - self.usable, not self.context_assumed, self.workspace)

    @property
    def peak(self) -> PhaseNeed:
        """The phase with the most live tensor bytes."""
        return max(self.phases, key=lambda p: p.tensors)

    @property
    def first_failure(self) -> PhaseNeed | None:
        """The phase that runs out first (None if both steps fit); step 0 means the model itself does not fit."""
        if self.failure is None:
            return None
        step, phase = self.failure
        found = [p for p in self.phases if (p.step, p.phase) == (step, phase)]
        return found[0] if found else PhaseNeed(step, phase, 0, 0, {})

    def verdict(self, detail: bool = True) -> str:
        """One sentence: fits or which phase of which step runs out first, by the simulated allocator's reserved
        memory (which decides), the tensors' peak beside it; "BUT TOO CLOSE TO CALL" where :attr:`close`."""
        pk = self.peak
        usable = size_text(self.usable)
        tensors = f"tensors peak at {size_text(pk.tensors)} (step {pk.step} {pk.phase})"
        if self.failure is None:
            answer = "FITS"
            top = max(self.phases, key=lambda p: p.reserved)
            if top.reserved <= self.usable:
                held = (
                    f"the simulated caching allocator reserves at most {size_text(top.reserved)} (step {top.step} "
                    f"{top.phase}) of {usable} usable"
                )
            else:
                held = (
                    f"the simulated caching allocator stays within {usable} usable only by giving cached segments back"
                )
        else:
            answer = "DOES NOT FIT"
            step, phase = self.failure
            where = "before step 1 (the model itself)" if step == 0 else f"in step {step}'s {phase} pass"
            held = f"the simulated caching allocator, capped at {usable} usable, runs out first {where}"
            if detail and self.oom is not None and self.oom.requested is not None:  # what it held and asked
                stuck = self.oom.reserved - self.oom.allocated
                held += (
                    f": with its entirely free segments given back it still holds {size_text(self.oom.reserved)}, "
                    f"{size_text(self.oom.allocated)} in tensors and {size_text(stuck)} in free blocks of partly "
                    f"used segments, none of which can take the next {size_text(self.oom.requested)} tensor, and "
                    f"a new {size_text(self.oom.segment)} segment goes over the cap"
                )
        if self.close:
            answer += ", BUT TOO CLOSE TO CALL"
        return f"{self.label} on {self.device}: {answer}: {held}; {tensors}"

    def margin(self) -> str:
        """How far the answer is from turning, against what is assumed (:attr:`allowance`)."""
        parts = []
        if self.context_assumed:
            parts.append(f"the CUDA context {size_text(self.capacity - self.usable)}, taken out of the usable memory")
        if self.workspace:
            parts.append(f"cuBLAS and cuBLASLt workspaces up to {size_text(self.workspace)}, not counted")
        assumed = f"assumed, not measured: {'; '.join(parts)}" if parts else "the CUDA context is measured"
        more = "less" if self.fits else "more"
        if not self.allowance:
            turn = "nothing is assumed that could turn the answer"
        elif self.close:
            turn = f"TOO CLOSE TO CALL: with {size_text(self.allowance)} {more} memory the simulated answer turns"
        else:
            turn = f"the answer holds with {size_text(self.allowance)} {more} memory"
        return f"margin: {turn} ({assumed}); kernel scratch is not counted at all"

    def assumption_lines(self) -> tuple[str, ...]:
        """The step's assumptions, then the device's: its rules, what is not counted, the CUDA context."""
        not_counted = "kernel scratch (temporary buffers inside ops)"
        if self.workspace:
            not_counted += f", cuBLAS and cuBLASLt workspaces (up to {size_text(self.workspace)})"
        context = size_text(self.capacity - self.usable)
        context += " assumed, not measured" if self.context_assumed else " measured on this GPU"
        return (
            *self.assumptions,
            f"device rules: {self.rules}",
            f"not counted: {not_counted}",
            f"CUDA context: {context} (the driver's state, the kernels' code, the libraries' handles)",
        )

    def decision_lines(self) -> list[str]:
        """The verdict, what decides it, its margin and what a learner can do on their own GPU."""
        lines = [self.verdict(), RESERVED_DECIDES]
        edge = self.close or (not self.fits and self.peak.tensors <= self.usable)
        if not self.fits and self.peak.tensors <= self.usable:
            lines[-1] += f": the tensors alone ({size_text(self.peak.tensors)}) would fit, the segments do not"
        lines += [self.margin(), YOUR_CARD]
        if edge:
            lines.append(NEAR_THE_EDGE)
        return lines

    def __str__(self) -> str:  # print(report) shows the table, its assumptions and verdict
        return self.table()

    def table(self, brief: bool = False) -> str:
        """The phases (tensors beside reserved, the capped allocator's outcome), the usable memory, the assumptions,
        then :meth:`decision_lines` and the report's note. ``brief`` (a slider panel, whose figure must stay in
        view): the phases, the usable memory and the verdict, with a pointer to the whole answer."""
        unit, scale = pick_unit(max(p.reserved for p in self.phases))  # the rows' unit suits the step, not the GPU
        cols = [Col("step", 4), Col("phase", 9, align="<", gap="  "), Col("tensors", 9, ".2f")]
        cols += [Col("reserved", 9, ".2f"), Col("tensors fit", 11), Col("allocator (decides)", 19)]
        order = [(p.step, p.phase) for p in self.phases]
        ran_out = order.index(self.failure) if self.failure in order else 0

        def reached(i: int) -> bool:  # a phase after the one that ran out never runs: neither column answers for it
            return self.failure is None or i <= ran_out and self.failure in order

        def capped(i: int) -> str:
            if not reached(i):
                return "-"
            return "RUNS OUT" if self.failure is not None and i == ran_out else "ok"

        rows = [
            (p.step, p.phase, p.tensors / scale, p.reserved / scale,
             ("yes" if p.tensors <= self.usable else "NO") if reached(i) else "-", capped(i))
            for i, p in enumerate(self.phases)
        ]  # fmt: skip
        if brief:
            usable = f"usable on {self.device}: {size_text(self.usable)} (print the report: how, and assumptions)"
            footer = [usable, self.verdict(detail=False), *([self.note] if self.note else [])]
            return format_table(cols, rows, note=f"({unit}; -: not reached)", footer=footer)
        usable = (
            f"usable on {self.device}: {size_text(self.usable)} = {size_text(self.capacity)} "
            f"{self.capacity_note + ' ' if self.capacity_note else ''}"
            f"- {size_text(self.capacity - self.usable)} {self.context_note}"
        )
        footer = [
            usable,
            "assumptions:",
            *(f"  - {line}" for line in self.assumption_lines()),
            *self.decision_lines(),
        ]
        if self.note:
            footer.append(self.note)
        note = (
            f"({unit}; reserved: the simulated caching allocator without a cap, at the phase's tensor peak; "
            "allocator: the same capped at the usable memory, which decides; -: not reached, after the phase that "
            "ran out)"
        )
        return format_table(cols, rows, note=note, footer=footer)
