"""Markdown rendering of a :class:`~reports.document.Document`.

Strings from results files (engine names, labels, error messages) are
escaped so they can neither break a table (a ``|`` or a newline) nor inject
markup or raw HTML into a rendered page. Plots exist only in report.html;
Markdown says where to find them.
"""

from __future__ import annotations

import re

from batchbench.reports.document import Block, Bullets, Cell, Document, Para, Plot, Section, Table

_SPECIAL = re.compile(r"([\\`*\[\]<>|#!])")
_EDGE_UNDERSCORE = re.compile(r"(?<!\w)_|_(?!\w)")


def escape(text: str) -> str:
    """Raw text as inert Markdown on one line (underscores inside words are left alone, as GFM does)."""
    text = " ".join(text.split())  # newlines and tabs would end a table row or a list item
    text = text.replace("&", "&amp;")
    text = _SPECIAL.sub(r"\\\1", text)
    return _EDGE_UNDERSCORE.sub(r"\\_", text)


def _cell(cell: Cell) -> str:
    text = escape(cell.text)
    return f"**{text}**" if cell.style == "best" and text else text


def _table(table: Table) -> list[str]:
    lines = ["| " + " | ".join(escape(h) for h in table.header) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(table.header) - 1)) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in table.rows]
    if table.caption:
        lines += ["", f"*{escape(table.caption)}*"]
    return lines


def _block(block: Block) -> list[str]:
    if isinstance(block, Para):
        return [escape(block.text), ""]
    if isinstance(block, Bullets):
        return [f"- {escape(item)}" for item in block.items] + [""]
    if isinstance(block, Table):
        return _table(block) + [""]
    if isinstance(block, Plot):
        return []  # figures are counted per section, see _section
    return _section(block)


def _section(section: Section) -> list[str]:
    lines = ["#" * section.level + " " + escape(section.title), ""]
    plots = [b for b in section.blocks if isinstance(b, Plot)]
    if len(plots) == 1:
        lines += [f"*(figure in report.html: {escape(plots[0].title)})*", ""]
    elif plots:
        lines += [f"*({len(plots)} figures in report.html)*", ""]
    for block in section.blocks:
        lines += _block(block)
    return lines


def render(doc: Document) -> str:
    lines = [f"# {escape(doc.title)}", ""]
    for section in doc.sections:
        lines += _section(section)
    return "\n".join(lines).rstrip() + "\n"
