"""Self-contained HTML rendering of a :class:`~reports.document.Document`.

One file that opens anywhere, offline, forever: inline CSS, figures as
inline SVG (text as text, each figure's ids and classes prefixed so none
collide), no scripts, fonts or links to the outside. Every string is
HTML-escaped (quotes included), because engine labels, error messages and
file names come from results files that anyone can write; the text inside a
figure was escaped by the SVG's serialiser.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from html import escape

from batchbench.reports import svg
from batchbench.reports.blocks import Block, Bullets, Cell, Details, Document, Para, Plot, Section, Table

#: What an anchor may be: it is written unescaped into ids and links.
_ANCHOR = re.compile(r"[a-z0-9-]+")

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1400px; padding: 0 1rem; color: #222; }
h1, h2, h3 { font-weight: 600; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2rem; margin-top: 2.5rem; }
table { border-collapse: collapse; margin: .8rem 0; font-size: .9rem; }
th, td { border: 1px solid #ccc; padding: .3rem .6rem; text-align: right; vertical-align: top; }
th:first-child, td:first-child { text-align: left; }
thead th { background: #f2f2f2; }
table.prose td { text-align: left; } table.prose a { color: inherit; text-decoration-color: #bbb; }
td.best { font-weight: 700; } td.bad, p.bad, li.bad { background: #fde2e1; color: #8a1c14; }
td.warn, p.warn, li.warn { background: #fff4d6; color: #6b4e00; }
caption { caption-side: bottom; text-align: left; font-size: .8rem; color: #555; padding-top: .3rem; }
figure { margin: 1rem 0; } figure svg { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: .85rem; color: #555; }
nav ul { columns: 2; font-size: .9rem; }
details { margin: .8rem 0; } summary { cursor: pointer; color: #444; }
body > section { content-visibility: auto; contain-intrinsic-size: auto 900px; }
"""


def _style(style: str) -> str:
    return f' class="{style}"' if style else ""


def _table(table: Table) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in table.header)
    body = []
    for row in table.rows:
        cells = [f"<th>{escape(row[0].text)}</th>"] if row else []
        cells += [f"<td{_style(c.style)}>{_cell_text(c)}</td>" for c in row[1:]]
        body.append("<tr>" + "".join(cells) + "</tr>")
    caption = f"<caption>{escape(table.caption)}</caption>" if table.caption else ""
    kind = ' class="prose"' if table.prose else ""
    return f"<table{kind}>{caption}<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _cell_text(cell: Cell) -> str:
    if cell.link and _ANCHOR.fullmatch(cell.link):
        return f'<a href="#{cell.link}">{escape(cell.text)}</a>'
    return escape(cell.text)


def _plot(plot: Plot, number: int) -> str:
    figure = svg.inline(plot.svg, prefix=f"f{number}-", label=plot.title)
    return f"<figure>{figure}<figcaption>{escape(plot.title)}</figcaption></figure>"


Figures = Iterator[int]


def _block(block: Block, anchors: dict[int, str], figures: Figures) -> str:
    if isinstance(block, Para):
        return f"<p{_style(block.style)}>{escape(block.text)}</p>"
    if isinstance(block, Bullets):
        return "<ul>" + "".join(f"<li{_style(block.style)}>{escape(i)}</li>" for i in block.items) + "</ul>"
    if isinstance(block, Table):
        return _table(block)
    if isinstance(block, Plot):
        return _plot(block, next(figures))
    if isinstance(block, Details):
        inner = "\n".join(_block(b, anchors, figures) for b in block.blocks)
        return f"<details><summary>{escape(block.summary)}</summary>\n{inner}</details>"
    return _section(block, anchors, figures)


def _section(section: Section, anchors: dict[int, str], figures: Figures) -> str:
    level = min(max(section.level, 2), 6)
    anchor = section.anchor if _ANCHOR.fullmatch(section.anchor) else anchors.get(id(section))
    ident = f' id="{anchor}"' if anchor else ""
    inner = "\n".join(_block(b, anchors, figures) for b in section.blocks)
    return f"<section><h{level}{ident}>{escape(section.title)}</h{level}>\n{inner}</section>"


def render(doc: Document) -> str:
    """The page; its contents are folded away so the first screen is the first section (the answer).

    Each top-level section is ``content-visibility: auto``: the browser lays out and paints a section only as it
    nears the screen, so opening the page costs the first screen, not dozens of figures and tables below it
    (a browser without it draws everything, as before; find-in-page and links into a section still work)."""
    anchors = {id(s): s.anchor if _ANCHOR.fullmatch(s.anchor) else f"s{i}" for i, s in enumerate(doc.sections, 1)}
    nav = "".join(f'<li><a href="#{anchors[id(s)]}">{escape(s.title)}</a></li>' for s in doc.sections)
    figures = itertools.count(1)  # numbers each figure's prefix, in page order
    body = "\n".join(_section(s, anchors, figures) for s in doc.sections)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{escape(doc.title)}</title><style>{_CSS}</style></head>\n"
        f"<body><h1>{escape(doc.title)}</h1><nav><details><summary>Contents</summary><ul>{nav}</ul></details></nav>\n"
        f"{body}\n</body></html>\n"
    )
