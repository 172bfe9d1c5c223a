"""Figures as small inline SVG: matplotlib's SVG canvas, then the markup cut down to what a browser draws.

The report inlines every figure into one HTML file, so each byte of markup is read, parsed and laid out by every
reader's browser. Text stays text (``svg.fonttype: none``: no glyph outlines, and it can be searched and copied);
paths are simplified; then :func:`to_svg` drops what matplotlib writes for editors rather than browsers (the XML
prolog and DOCTYPE, metadata, the id of every group, indentation, six-decimal coordinates, a long font fallback
list on every label). Ids that something refers to (clip paths, markers) stay, and :func:`inline` prefixes them
when a figure is inlined, so two figures on one page never share one. The same figure gives the same text: ids are
hashed with a fixed salt.
"""

from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import matplotlib
from matplotlib.backends.backend_svg import FigureCanvasSVG
from matplotlib.figure import Figure

from batchbench.reports.svg_path import relative

if TYPE_CHECKING:  # the rc keys as a type, for the checker only (not in every matplotlib this runs on)
    from matplotlib.typing import RcKeyType

_SVG_NS = "{http://www.w3.org/2000/svg}"
_XLINK_HREF = "{http://www.w3.org/1999/xlink}href"

#: matplotlib's settings for every figure: text as text in one font (the one its layout measured), simplified
#: paths, ids hashed with a constant so the output is reproducible.
_RC: dict[RcKeyType, Any] = {
    "svg.fonttype": "none",
    "svg.hashsalt": "batchbench",
    "path.simplify": True,
    "path.simplify_threshold": 0.5,
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans"],
}
#: No <metadata> block (creator, date, format): nothing a reader sees, and a date would change every build.
_NO_METADATA = {"Creator": None, "Date": None, "Format": None, "Type": None}

#: Attributes holding coordinates, whose numbers are cut to a tenth of a point (as paths are, in svg_path).
_GEOMETRY = frozenset({"x", "y", "width", "height", "transform", "viewBox"})
_NUMBER = re.compile(r"-?\d+\.\d+")
#: A text's rotation by nothing, which matplotlib writes on every label.
_NO_ROTATION = re.compile(r"rotate\(-?0 [-\d.]+ [-\d.]+\)")
_REFERENCE = re.compile(r"url\(#([^)]+)\)")
#: A class selector of :func:`_classes`' rules (a declaration never holds a "{").
_CLASS_RULE = re.compile(r"\.(s\d+)(?=\{)")


def _short(match: re.Match[str]) -> str:
    text = f"{float(match.group()):.1f}".removesuffix(".0")
    return "0" if text == "-0" else text


def _walk(elem: ET.Element) -> Iterator[ET.Element]:
    yield elem
    for child in elem:
        yield from _walk(child)


def _references(root: ET.Element) -> set[str]:
    """Ids something points at: ``href="#id"`` (markers) and ``url(#id)`` (clip paths)."""
    found: set[str] = set()
    for elem in _walk(root):
        for name, value in elem.attrib.items():
            if name in ("href", _XLINK_HREF) and value.startswith("#"):
                found.add(value[1:])
            found.update(_REFERENCE.findall(value))
    return found


def _unwrap(parent: ET.Element) -> None:
    """Fewer groups, in place: a bare ``<g>`` (no attributes left) hands its children to its parent, neighbouring
    groups with the same attributes (a scatter's points, clipped alike) become one, and a group that only clips
    one path hands its clip to the path (a ``<use>`` keeps its group: its x and y would move the clip with it)."""
    i = 0
    while i < len(parent):
        child = parent[i]
        _unwrap(child)
        if child.tag == "g" and set(child.attrib) == {"clip-path"} and len(child) == 1 and child[0].tag == "path" \
                and not {"clip-path", "transform"} & set(child[0].attrib):
            child[0].set("clip-path", child.attrib.pop("clip-path"))
        if child.tag == "g" and not child.attrib:
            parent[i:i + 1] = list(child)
            continue
        if i and child.tag == "g" and parent[i - 1].tag == "g" and parent[i - 1].attrib == child.attrib:
            parent[i - 1].extend(list(child))
            del parent[i]
            continue
        i += 1


def _css(style: str) -> str:
    """A style attribute's declarations without the spaces matplotlib puts after each colon and semicolon."""
    return ";".join(":".join(p.strip() for p in d.split(":", 1)) for d in style.split(";") if d.strip())


def _classes(root: ET.Element) -> None:
    """Each distinct ``style`` becomes one class (``s0``, ``s1``...) in a ``<style>`` of the figure's own.

    matplotlib writes the whole style on every element: a line's markers repeat the same colours hundreds of
    times. The class names are local to the figure until :func:`inline` prefixes them."""
    names: dict[str, str] = {}
    for elem in _walk(root):
        if (style := elem.attrib.pop("style", None)) is not None:
            name = names.setdefault(_css(style), f"s{len(names)}")
            elem.set("class", f"{elem.get('class')} {name}" if elem.get("class") else name)
    if names:
        rules = "".join(f".{name}{{{css}}}" for css, name in names.items())
        sheet = ET.Element("style")
        sheet.text = rules
        root.insert(0, sheet)


def _hoist_definitions(root: ET.Element) -> None:
    """Every ``<defs>`` entry into one ``<defs>`` first: definitions draw nothing where they stand, and out of the
    way, the groups between them can merge (:func:`_unwrap`)."""
    found: list[ET.Element] = []
    for elem in list(_walk(root)):
        for defs in elem.findall("defs"):
            found += list(defs)
            elem.remove(defs)
    if found:
        defs = ET.Element("defs")
        defs.extend(found)
        root.insert(0, defs)


def _drop_page_rule(root: ET.Element) -> None:
    """matplotlib's ``<style>`` rule (``*{stroke-linejoin: round; stroke-linecap: butt}``) would apply to the whole
    HTML page once inlined; it becomes the same two properties on the root, which every element inherits."""
    for defs in root.findall(f"{_SVG_NS}defs"):
        for style in defs.findall(f"{_SVG_NS}style"):
            defs.remove(style)
        if not len(defs):
            root.remove(defs)
    root.attrib.pop("version", None)
    root.set("stroke-linejoin", "round")
    root.set("stroke-linecap", "butt")


def _shorten(elem: ET.Element, short: dict[str, str]) -> None:
    """One element's local tag name, plain ``href``, its id only if referenced (by its short name), and short
    coordinates."""
    elem.tag = elem.tag.removeprefix(_SVG_NS)
    if _XLINK_HREF in elem.attrib:
        elem.attrib["href"] = elem.attrib.pop(_XLINK_HREF)
    if (ident := elem.attrib.pop("id", None)) in short:
        elem.set("id", short[ident])
    if _NO_ROTATION.fullmatch(elem.get("transform", "")):
        del elem.attrib["transform"]
    for name, value in elem.attrib.items():
        if name == "d":
            elem.set(name, relative(value))
        elif name in _GEOMETRY:
            elem.set(name, _NUMBER.sub(_short, " ".join(value.split())))
        elif name == "href" and value[1:] in short:
            elem.set(name, "#" + short[value[1:]])
        elif "url(#" in value:
            elem.set(name, _REFERENCE.sub(lambda m: f"url(#{short[m.group(1)]})", value))


def _strip_indentation(elem: ET.Element) -> None:
    """No whitespace-only text between tags, except inside a label (there every space is the label's)."""
    if elem.tag == "text":
        return
    if elem.text is not None and not elem.text.strip():
        elem.text = None
    for child in elem:
        if child.tail is not None and not child.tail.strip():
            child.tail = None
        _strip_indentation(child)


def _clean(root: ET.Element) -> None:
    """matplotlib's SVG cut down to what a browser draws, in place (see the module's docstring)."""
    _drop_page_rule(root)
    # matplotlib's ids are hashes ("m1504cfccaf"), repeated in every reference: short names, in order, instead
    short = {ident: f"i{n}" for n, ident in enumerate(sorted(_references(root)))}
    for elem in _walk(root):
        _shorten(elem, short)
    _strip_indentation(root)
    _hoist_definitions(root)
    _unwrap(root)
    _classes(root)


def _serialise(root: ET.Element) -> str:
    # ElementTree escapes ">" in text and attributes alike, so " />" can only end an empty tag.
    return ET.tostring(root, encoding="unicode").replace(" />", "/>")


def to_svg(fig: Figure) -> str:
    """The figure as one ``<svg>`` element, ready to inline in HTML (through :func:`inline`)."""
    FigureCanvasSVG(fig)
    buf = io.StringIO()
    with matplotlib.rc_context(_RC):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata=_NO_METADATA)
    root = ET.fromstring(buf.getvalue())
    _clean(root)
    return _serialise(root)


def inline(svg: str, *, prefix: str, label: str) -> str:
    """``svg`` (from :func:`to_svg`) as it goes into a page: every id and class, and every reference to one,
    prefixed, and ``label`` as its accessible name (an image's alt text).

    A page that inlines many figures shares one namespace of ids, and an inline ``<style>`` applies to the whole
    page: unprefixed, the second figure's ``s0`` would restyle the first's."""
    root = ET.fromstring(svg)
    for elem in _walk(root):
        if (ident := elem.get("id")) is not None:
            elem.set("id", prefix + ident)
        if (classes := elem.get("class")) is not None:
            elem.set("class", " ".join(prefix + c for c in classes.split()))
        for name, value in elem.attrib.items():
            if name == "href" and value.startswith("#"):
                elem.set(name, "#" + prefix + value[1:])
            elif "url(#" in value:
                elem.set(name, value.replace("url(#", "url(#" + prefix))
        if elem.tag == "style" and elem.text:
            elem.text = _CLASS_RULE.sub(lambda m: "." + prefix + m.group(1), elem.text)
    root.set("role", "img")
    root.set("aria-label", label)
    return _serialise(root)
