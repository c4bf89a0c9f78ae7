"""One formatter for every text table the course prints (fixed-width columns, a rule under the header)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Col:
    """A column: its header, its width in characters, and how a value is written.

    ``fmt`` is a format spec without width (``".2f"``, ``",d"``, ``"+,d"``, ``""``); ``align`` is ``"<"`` or ``">"``;
    ``gap`` is the text written before the column (a space by default).
    """

    name: str
    width: int
    fmt: str = ""
    align: str = ">"
    gap: str = " "

    def cell(self, value) -> str:
        if value is None or isinstance(value, str):
            return f"{self.gap}{'-' if value is None else value:{self.align}{self.width}}"
        sign, fmt = ("+", self.fmt[1:]) if self.fmt.startswith("+") else ("", self.fmt)
        return f"{self.gap}{value:{self.align}{sign}{self.width}{fmt}}"

    def head(self) -> str:
        return f"{self.gap}{self.name[: self.width]:{self.align}{self.width}}"


def format_table(cols: Sequence[Col], rows: Iterable[Sequence], *, note: str = "", footer: Iterable[str] = ()) -> str:
    """The rows as text, one line each, under a header line (with ``note`` after it, e.g. "(MiB)") and a rule.

    Each row has one value per column (None shows as "-"). ``footer`` lines follow a second rule.
    """
    cut = len(cols[0].gap) if cols else 0
    head = "".join(c.head() for c in cols)[cut:]
    lines = [head + (f"   {note}" if note else ""), "-" * len(head)]
    for row in rows:
        if len(row) != len(cols):
            raise ValueError(f"a row has {len(row)} values for {len(cols)} columns: {row!r}")
        lines.append("".join(c.cell(v) for c, v in zip(cols, row))[cut:])
    footer = list(footer)
    if footer:
        lines += ["-" * len(head), *footer]
    return "\n".join(line.rstrip() for line in lines)
