"""The one markdown table every benchmark script ends with (issue 48): a results page pastes it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def ratio(numerator: float, denominator: float, digits: int = 2) -> str:
    """`numerator / denominator` as `1.23x`; `-` where the denominator is zero or missing."""
    if numerator is None or not denominator:
        return "-"
    return f"{numerator / denominator:,.{digits}f}x"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub markdown table: one header row, a separator, one line per row. Cells are
    str()-ed (format numbers before), `|` in a cell is escaped, and numeric-looking columns are
    right-aligned."""
    rows = [[_cell(value) for value in row] for row in rows]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"a row of {len(row)} cells under {len(headers)} headers: {row}")
    align = ["---:" if rows and all(_numeric(row[i]) for row in rows) else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: object) -> str:
    return ("-" if value is None else str(value)).replace("|", "\\|").replace("\n", " ")


def _numeric(cell: str) -> bool:
    text = cell.replace(",", "").replace("_", "").rstrip("x%").strip()
    if text in ("-", ""):
        return True
    try:
        float(text)
    except ValueError:
        return False
    return True
