"""The report's figures as inline SVG: markup a page can hold many of, path data that draws what matplotlib drew,
and the answer's headline figure."""

from __future__ import annotations

import math
import re
from html.parser import HTMLParser
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from matplotlib.figure import Figure

from batchbench.reports import markdown, render_html
from batchbench.reports.blocks import Document, Plot, Section
from batchbench.reports.build import build_report
from batchbench.reports.headline import HeadlinePoint, headline_svg
from batchbench.reports.svg import inline, to_svg
from batchbench.reports.svg_path import relative
from tests.test_reports import BatchingConfig, write_run


def figure(title: str = "a title") -> str:
    """A small figure with what the report's figures hold: lines, markers (``<use>``), clipping, text."""
    fig = Figure(figsize=(3, 2))
    ax = fig.add_subplot()
    ax.errorbar([1, 2, 3], [1, 4, 9], yerr=[0.5, 0.5, 1.0], fmt="-o", capsize=2, label="a line")
    ax.scatter([1.5, 2.5], [2, 6], s=200, alpha=0.3)
    ax.set_title(title)
    ax.legend()
    return to_svg(fig)


class Tags(HTMLParser):
    """Start tags with their attributes and the text between them, as a browser's parser reads a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def parse(html: str) -> Tags:
    tags = Tags()
    tags.feed(html)
    return tags


def test_a_figure_is_one_svg_element_with_its_text_as_text() -> None:
    svg = figure("Latency vs throughput")
    assert svg.startswith("<svg ") and svg.endswith("</svg>")
    assert "<?xml" not in svg and "<!DOCTYPE" not in svg and "<metadata" not in svg and "xmlns" not in svg
    assert ">Latency vs throughput</text>" in svg  # a font's glyphs would be paths: here the words are text
    assert "*{" not in svg  # matplotlib's page-wide rule is gone
    assert svg == figure("Latency vs throughput")  # the same figure, the same text


def test_inlined_figures_share_no_id_or_class_and_every_reference_resolves_in_its_own() -> None:
    first, second = figure(), figure()
    assert first == second  # identical figures: without prefixes every id and class would collide
    page = inline(first, prefix="f1-", label="one") + inline(second, prefix="f2-", label="two")
    ids = re.findall(r' id="([^"]+)"', page)
    assert ids and len(ids) == len(set(ids))
    for number, svg in enumerate(re.findall(r"<svg .*?</svg>", page), 1):
        own = set(re.findall(r' id="([^"]+)"', svg))
        refs = set(re.findall(r'href="#([^"]+)"', svg)) | set(re.findall(r"url\(#([^)]+)\)", svg))
        assert refs and refs <= own and all(i.startswith(f"f{number}-") for i in own)
        classes = {c for group in re.findall(r' class="([^"]+)"', svg) for c in group.split()}
        rules = set(re.findall(r"\.([\w-]+)\{", re.search(r"<style>(.*?)</style>", svg).group(1)))
        assert classes == rules and all(c.startswith(f"f{number}-") for c in classes)


def test_text_from_results_stays_text_inside_a_figure() -> None:
    evil = '<script>alert("x")</script>'
    page = render_html.render(Document("t", [Section("s", blocks=[Plot(evil, figure(evil))])]))
    assert "<script" not in page
    tags = parse(page)
    assert "script" not in {t for t, _ in tags.tags}
    assert evil in tags.text  # the title, as the reader sees it
    svg = next(attrs for t, attrs in tags.tags if t == "svg")
    assert svg["aria-label"] == evil and svg["role"] == "img"


def test_markdown_gives_each_figure_a_line_of_its_own() -> None:
    doc = Document("t", [Section("s", blocks=[Plot("First | figure", figure()), Plot("Second", figure())])])
    md = markdown.render(doc)
    assert "*Figure in report.html: First \\| figure*" in md and "*Figure in report.html: Second*" in md
    assert "<svg" not in md


def test_a_workload_has_one_figure_a_line_per_run(tmp_path: Path) -> None:
    results = tmp_path / "results"
    for repeat in range(3):
        write_run(results, engine="vllm", labels={"concurrency": 4, "repeat": repeat}, peak_kv=0.9,
                  name=f"vllm_r{repeat}")
    write_run(results, engine="hf-static", batching=BatchingConfig("static", max_batch_size=4), peak_kv=None,
              labels={"concurrency": 8}, concurrency=8)
    build_report(results, tmp_path / "out", warn=lambda m: None, findings=None)
    html = (tmp_path / "out" / "report.html").read_text()
    captions = re.findall(r'<svg [^>]*aria-label="Per run on ([^"]+)"', html)
    assert len(captions) == 2  # two workloads (concurrency 4 and 8), one figure each
    first = re.findall(r"<svg .*?</svg>", html)[1]  # after the latency-throughput figure
    for repeat in range(3):  # each run named by what sets it apart: its repeat
        assert f"vllm [continuous-bs4] repeat={repeat}</text>" in first
    assert "design=" not in first


# --------------------------------------------------------------------------- path data


def absolute(d: str) -> list[tuple[str, list[float]]]:
    """Relative path data back to absolute segments (command, coordinates), repeated letters spelled out."""
    out: list[tuple[str, list[float]]] = []
    x = y = sx = sy = 0.0
    tokens = re.findall(r"[a-zA-Z]|-?(?:\d+\.?\d*|\.\d+)", d)
    command, i = "", 0
    while i < len(tokens):
        if tokens[i].isalpha():
            command = tokens[i]
            i += 1
            if command == "z":
                out.append(("Z", []))
                x, y = sx, sy
                continue
        pairs = {"m": 1, "l": 1, "q": 2, "c": 3}[command]
        steps = [float(t) for t in tokens[i:i + 2 * pairs]]
        i += 2 * pairs
        points = [s + (x if k % 2 == 0 else y) for k, s in enumerate(steps)]
        out.append((command.upper(), points))
        x, y = points[-2], points[-1]
        if command == "m":
            sx, sy = x, y
            command = "l"  # pairs after a moveto are linetos
    return out


coordinate = st.floats(-2000, 2000, allow_nan=False).map(lambda v: round(v, 6))
segment = st.one_of(
    st.tuples(st.sampled_from("ML"), st.lists(coordinate, min_size=2, max_size=2)),
    st.tuples(st.just("Q"), st.lists(coordinate, min_size=4, max_size=4)),
    st.tuples(st.just("C"), st.lists(coordinate, min_size=6, max_size=6)),
    st.tuples(st.just("z"), st.just([])),
)


@given(st.tuples(st.just("M"), st.lists(coordinate, min_size=2, max_size=2)), st.lists(segment, max_size=30))
def test_relative_path_data_draws_the_absolute_path_to_a_tenth_of_a_point(
        start: tuple[str, list[float]], rest: list[tuple[str, list[float]]]) -> None:
    segments = [start, *rest]
    d = " ".join(f"{c} " + " ".join(f"{v:f}" for v in values) for c, values in segments)
    decoded = absolute(relative(d))
    assert [c for c, _ in decoded] == [c.upper() for c, _ in segments]
    for (_, got), (_, want) in zip(decoded, segments):
        assert all(math.isclose(g, round(w * 10) / 10, abs_tol=1e-6) for g, w in zip(got, want))


def test_path_data_it_does_not_know_is_left_as_it_came() -> None:
    assert relative("M 0 0 A 5 5 0 0 1 10 10") == "M 0 0 A 5 5 0 0 1 10 10"
    assert relative("M 0 0 L 1") == "M 0 0 L 1"
    assert relative("M 0 0 L 1.25 -0.5 L 3 -0.5 z") == "m0 0 1.2-.5 1.8 0z"


# --------------------------------------------------------------------------- the headline figure


def sweep(valid_up_to: int = 16) -> list[HeadlinePoint]:
    return [HeadlinePoint(c, (100.0 * min(c, 8), 90.0 * min(c, 8), 110.0 * min(c, 8)),
                          (0.02 * max(1, c / 8) ** 3, 0.015, 0.03 * max(1, c / 8) ** 3), valid=c <= valid_up_to)
            for c in (1, 2, 4, 8, 16, 32)]


def texts(svg: str) -> list[str]:
    return re.findall(r"<text [^>]*>([^<]*)</text>", svg)


def test_the_headline_labels_each_batch_size_the_sweet_spot_and_the_slo() -> None:
    svg = headline_svg("vllm", sweep(), sweet_spot=8, slo_ttft_p99_s=0.2, color="C1")
    assert svg is not None
    words = texts(svg)
    assert {"c=1", "c=2", "c=4", "c=8", "c=16", "c=32"} <= set(words)
    assert "sweet spot c=8" in words and "TTFT p99 SLO 200 ms" in words
    assert "vllm: throughput against TTFT p99 by batch size" in words
    assert "output tokens/s" in words and "TTFT p99 (ms)" in words
    assert "invalid (not used)" in words  # c=32 is hollow and grey, and the legend says why
    assert "#999999" in svg
    width, height = (float(v) for v in re.match(r'<svg width="([\d.]+)pt" height="([\d.]+)pt"', svg).groups())
    assert 300 < width < 450 and 200 < height < 320  # about 5 x 3.5 inches (72 pt each)


def test_the_headline_without_a_sweet_spot_an_slo_or_invalid_points_draws_none_of_them() -> None:
    svg = headline_svg("tgi", sweep(valid_up_to=32), sweet_spot=None, slo_ttft_p99_s=None, color="C2")
    assert svg is not None
    words = texts(svg)
    assert not [w for w in words if "sweet spot" in w or "SLO" in w or "invalid" in w]
    # a sweet spot that names no valid point drawn is not ringed either; nor is a non-positive SLO a line
    svg = headline_svg("tgi", sweep(valid_up_to=8), sweet_spot=16, slo_ttft_p99_s=0.0, color="C2")
    assert svg is not None and not [w for w in texts(svg) if "sweet spot" in w or "SLO" in w]


def test_the_headline_has_nothing_to_draw_without_a_point_with_both_figures() -> None:
    assert headline_svg("vllm", [], sweet_spot=None, slo_ttft_p99_s=None, color="C0") is None
    nan = [HeadlinePoint(8, (math.nan, 0.0, 0.0), (0.1, 0.1, 0.1)), HeadlinePoint(16, (5.0, 4.0, 6.0),
                                                                                  (math.inf, 0.0, 0.0))]
    assert headline_svg("vllm", nan, sweet_spot=8, slo_ttft_p99_s=0.2, color="C0") is None
    # a point's missing bounds are no error bar, not an error
    lone = [HeadlinePoint(4, (400.0, math.nan, math.nan), (0.05, math.nan, 0.02))]
    svg = headline_svg("", lone, sweet_spot=4, slo_ttft_p99_s=0.2, color="C0")
    assert svg is not None and "sweet spot c=4" in texts(svg)
    assert "Throughput against TTFT p99 by batch size" in texts(svg)
