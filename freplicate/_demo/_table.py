"""Aligned plain-text tables, for the demo's summary and ``freplicate bench``."""

from __future__ import annotations

from collections.abc import Sequence


def table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> list[str]:
    """The lines of a table: ``align`` has an ``l`` or ``r`` per column; a rule under the header."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)
        ).rstrip()

    return [line(header), line(["-" * w for w in widths]), *map(line, rows)]
