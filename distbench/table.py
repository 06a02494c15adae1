"""Plain-text tables sized to their values: every column as wide as its widest cell, two spaces apart.

Used by every distbench table (run summary, compare, sweep) so large values never run together.
"""

from __future__ import annotations

from collections.abc import Sequence


def render(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """``left``: how many leading columns are left-aligned (labels); the rest are right-aligned."""
    cols = len(header)
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(cols)]

    def line(cells: Sequence[str]) -> str:
        out = [str(c).ljust(w) if i < left else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    return "\n".join(line(r) for r in (header, *rows))
