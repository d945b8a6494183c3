"""The human-readable form of a benchmark's figures: what `ds4-mlx bench ...` prints without --json.

The figures are the same dict --json prints: plain values become a two-column table, and each list of
rows (dicts with the same keys) a table with one column per key.
"""


def format_value(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if value == 0 or abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _is_figure(cell: str) -> bool:
    try:
        float(cell.replace(",", ""))
        return True
    except ValueError:
        return cell in ("None", "True", "False", "")


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    # the first column is a name (left-aligned); the others are figures (right-aligned), or text
    # (left-aligned) where most cells are not numbers
    right = [i > 0 and 2 * sum(_is_figure(row[i]) for row in rows) >= len(rows) for i in range(len(header))]

    def line(cells):
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def format_figures(figures: dict) -> str:
    plain = [[key, format_value(value)] for key, value in figures.items() if not _is_rows(value)]
    parts = [table(["figure", "value"], plain)] if plain else []
    for key, rows in figures.items():
        if _is_rows(rows):
            columns = list(rows[0])
            parts.append(f"{key}:\n" + table(columns, [[format_value(row.get(c)) for c in columns] for row in rows]))
    return "\n\n".join(parts)


def _is_rows(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(row, dict) for row in value)
