"""Reports as text and as notebook HTML: column tables and key-value tables."""

from __future__ import annotations

import html
from collections.abc import Sequence


def text_columns(titles: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The title line and one line per row, each column padded to its widest cell.

    Example:
        >>> for line in text_columns(("name", "size"), [("w", "3×4"), ("bias", "4")]):
        ...     print(line)
        name  size
        w     3×4
        bias  4
    """
    widths = [max(len(title), *(len(row[i]) for row in rows)) if rows else len(title)
              for i, title in enumerate(titles)]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in (tuple(titles), *rows)]


def html_columns(titles: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """An HTML table with a header row (cells escaped, left-aligned).

    Example:
        >>> table = html_columns(("a",), [("<1>",)])
        >>> table.count("<tr>"), "&lt;1&gt;" in table
        (2, True)
    """
    def row_html(cells: Sequence[str], tag: str) -> str:
        return "<tr>" + "".join(f"<{tag} style='text-align:left'>{html.escape(cell)}</{tag}>"
                                for cell in cells) + "</tr>"

    return ("<table>" + row_html(titles, "th") + "".join(row_html(row, "td") for row in rows)
            + "</table>")


def html_lines(lines: Sequence[str]) -> str:
    """Each line as an escaped ``<div>``."""
    return "".join(f"<div>{html.escape(line)}</div>" for line in lines)


def key_values_text(title: str, rows: Sequence[tuple[str, str]]) -> str:
    """``title``, then one indented ``key  value`` line per row, the keys padded.

    Example:
        >>> print(key_values_text("Run", [("backend", "graph"), ("seconds", "0.1")]))
        Run
          backend  graph
          seconds  0.1
    """
    width = max((len(key) for key, _ in rows), default=0)
    return title + "".join(f"\n  {key.ljust(width)}  {value}" for key, value in rows)


def key_values_html(title: str, rows: Sequence[tuple[str, str]]) -> str:
    """An HTML table of ``rows`` (a key header cell and a value cell each) under ``title``."""
    body = "".join(f"<tr><th style='text-align:left'>{html.escape(key)}</th>"
                   f"<td style='text-align:left'>{html.escape(value)}</td></tr>"
                   for key, value in rows)
    return (f"<table><caption style='text-align:left'><b>{html.escape(title)}</b></caption>"
            f"{body}</table>")
