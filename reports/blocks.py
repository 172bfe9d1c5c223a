"""A renderer-neutral report: sections of paragraphs, bullet lists, tables and plots.

The Markdown and HTML outputs must say the same thing. Building the content
once, as plain data, and rendering it twice keeps them from drifting apart,
and keeps escaping in one place per output format (every string here is raw
text, often straight from a results file, and is escaped only by a renderer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

#: How a cell or paragraph should stand out: ``best`` (best value of a row),
#: ``bad`` (a regression, a danger zone, a failed run), ``warn`` (partial data).
Style = Literal["", "best", "bad", "warn"]


@dataclass(frozen=True)
class Cell:
    """One table cell: raw text and how it should stand out."""

    text: str
    style: Style = ""
    #: The ``anchor`` of a section this cell points to (its evidence), or "".
    link: str = ""


@dataclass
class Table:
    """A table with a header row; the first column names the row."""

    header: list[str]
    rows: list[list[Cell]]
    caption: str = ""
    #: Cells that are sentences, not figures: read from the left.
    prose: bool = False


@dataclass(frozen=True)
class Para:
    """A paragraph of raw text."""

    text: str
    style: Style = ""


@dataclass(frozen=True)
class Bullets:
    """A bullet list of raw text items."""

    items: list[str]
    style: Style = ""


@dataclass(frozen=True)
class Plot:
    """A figure: one ``<svg>`` element from :func:`batchbench.reports.svg.to_svg`, which the HTML report inlines
    (Markdown names it and points there)."""

    title: str
    svg: str


@dataclass
class Section:
    """A titled section; ``level`` 2 is a top-level section, 3 a subsection (nested in ``blocks``)."""

    title: str
    level: int = 2
    blocks: list[Block] = field(default_factory=list)
    #: A stable name a :class:`Cell` can link to ([a-z0-9-] only); "" when nothing links here.
    anchor: str = ""


@dataclass
class Details:
    """Blocks a reader opens on demand (the per-run tables behind a merged one): folded in HTML."""

    summary: str
    blocks: list[Block] = field(default_factory=list)


@dataclass
class Document:
    """The whole report, ready to render."""

    title: str
    sections: list[Section] = field(default_factory=list)


#: Anything a section holds; a nested Section is a subsection.
Block = Para | Bullets | Table | Plot | Section | Details
