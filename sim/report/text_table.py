"""A table as plain text, boxed as the console tables of earlier releases were drawn (rich's heavy-head box), for the
summary a run or a serve prints: no terminal library to import, the same text on a terminal and in a pipe."""
from __future__ import annotations


def text_table(header: list[str], rows: list[list[str]], title: str = "") -> str:
    """The table with its header row, each column as wide as its widest cell plus one space either side, left-aligned;
    `title` centred above it."""
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]

    def line(left: str, fill: str, mid: str, right: str) -> str:
        return left + mid.join(fill * (w + 2) for w in widths) + right

    def cells(bar: str, row: list[str]) -> str:
        return bar + bar.join(f" {str(c):<{w}} " for c, w in zip(row, widths)) + bar

    lines = [line("┏", "━", "┳", "┓"), cells("┃", header), line("┡", "━", "╇", "┩"),
             *(cells("│", r) for r in rows), line("└", "─", "┴", "┘")]
    if title:
        lines.insert(0, title.center(len(lines[0])).rstrip())
    return "\n".join(lines)
