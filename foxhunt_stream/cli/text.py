"""What the command line prints: byte counts, one-line errors and aligned tables."""

from __future__ import annotations

from typing import Iterable, Sequence

from ..errors import FormatError


def fmt_bytes(n: float) -> str:
    """Decimal units, like the GB/s figures: 1.07 GB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"


def describe_error(e: BaseException) -> str:
    """One readable line for any error (FormatError already names file, tensor and rule)."""
    if isinstance(e, KeyError) and e.args:
        text = str(e.args[0])
    elif isinstance(e, (FormatError, OSError, ValueError)):
        text = str(e)
    else:
        text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return " ".join(text.split())


def table(rows: Sequence[Sequence[str]], right: Iterable[int] = ()) -> list[str]:
    """Rows of cells as aligned lines: the columns in ``right`` right-aligned, the rest left."""
    right = set(right)
    widths = [max(map(len, col)) for col in zip(*rows)]
    fmt = "  ".join(f"{{:{'>' if i in right else '<'}{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*r).rstrip() for r in rows]
