"""Markdown rendering of a :class:`~reports.document.Document`.

Strings from results files (engine names, labels, error messages) are
escaped so they can neither break a table (a ``|`` or a newline) nor inject
markup or raw HTML into a rendered page. Figures exist only in report.html
(inline SVG there); in Markdown each is one line, its title, where it stands. A cell's link to a section points at the
heading's own anchor as GitHub-flavoured Markdown names it (:func:`slug`), so
no raw HTML is needed for it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from batchbench.reports.blocks import Block, Bullets, Cell, Details, Document, Para, Plot, Section, Table

_SPECIAL = re.compile(r"([\\`*\[\]<>|#!])")
_EDGE_UNDERSCORE = re.compile(r"(?<!\w)_|_(?!\w)")
_NOT_SLUG = re.compile(r"[^\w\- ]")


def escape(text: str) -> str:
    """Raw text as inert Markdown on one line (underscores inside words are left alone, as GFM does)."""
    text = " ".join(text.split())  # newlines and tabs would end a table row or a list item
    text = text.replace("&", "&amp;")
    text = _SPECIAL.sub(r"\\\1", text)
    return _EDGE_UNDERSCORE.sub(r"\\_", text)


def slug(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return _NOT_SLUG.sub("", " ".join(title.split()).lower()).replace(" ", "-")


def _headings(blocks: list[Block]) -> Iterator[Section]:
    for block in blocks:
        if isinstance(block, Section):
            yield block
        if isinstance(block, Section | Details):
            yield from _headings(block.blocks)


def _slugs(doc: Document) -> dict[str, str]:
    """Section anchor -> the heading's GitHub anchor (a repeated slug gets -1, -2, ... as GitHub numbers it)."""
    seen: dict[str, int] = {slug(doc.title): 1}
    out: dict[str, str] = {}
    for section in _headings(list(doc.sections)):
        base = slug(section.title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        if section.anchor:
            out[section.anchor] = base if n == 0 else f"{base}-{n}"
    return out


def _cell(cell: Cell, links: dict[str, str]) -> str:
    text = escape(cell.text)
    if cell.link in links and text:
        text = f"[{text}](#{links[cell.link]})"
    return f"**{text}**" if cell.style == "best" and text else text


def _table(table: Table, links: dict[str, str]) -> list[str]:
    lines = ["| " + " | ".join(escape(h) for h in table.header) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(table.header) - 1)) + "|"]
    lines += ["| " + " | ".join(_cell(c, links) for c in row) + " |" for row in table.rows]
    if table.caption:
        lines += ["", f"*{escape(table.caption)}*"]
    return lines


def _block(block: Block, links: dict[str, str]) -> list[str]:
    if isinstance(block, Para):
        return [escape(block.text), ""]
    if isinstance(block, Bullets):
        return [f"- {escape(item)}" for item in block.items] + [""]
    if isinstance(block, Table):
        return [*_table(block, links), ""]
    if isinstance(block, Plot):
        return [f"*Figure in report.html: {escape(block.title)}*", ""]
    if isinstance(block, Details):
        return [f"*{escape(block.summary)}:*", ""] + [line for b in block.blocks for line in _block(b, links)]
    return _section(block, links)


def _section(section: Section, links: dict[str, str]) -> list[str]:
    lines = ["#" * section.level + " " + escape(section.title), ""]
    for block in section.blocks:
        lines += _block(block, links)
    return lines


def render(doc: Document) -> str:
    links = _slugs(doc)
    lines = [f"# {escape(doc.title)}", ""]
    for section in doc.sections:
        lines += _section(section, links)
    return "\n".join(lines).rstrip() + "\n"
