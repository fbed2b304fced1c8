"""Plain-text formatting shared by the CLI and `phalanx top`: ages and
aligned tables (no imports beyond the standard library: the CLI's start-up
pays nothing for them)."""

from __future__ import annotations

from typing import Any, Sequence


def format_age(seconds: float) -> str:
    """``42s``, ``5m``, ``3h``, ``2d``; ``-`` for an unknown time."""
    if seconds != seconds or seconds < 0:
        return "-"
    if seconds < 120:
        return f"{int(seconds)}s"
    if seconds < 7200:
        return f"{int(seconds // 60)}m"
    if seconds < 2 * 86400:
        return f"{int(seconds // 3600)}h"
    return f"{int(seconds // 86400)}d"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces; the last column is not
    padded so long reasons do not leave trailing blanks."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [c.ljust(widths[i]) if i < len(row) - 1 else c for i, c in enumerate(row)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)
