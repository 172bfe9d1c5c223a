"""The figures behind the answer, drawn from the findings' points (means with their 95% intervals).

Each engine and layout is one line: the engine gives the colour (the same as in
every other figure of the report), the layout the line style. Error bars are
the points' intervals, so a reader sees at a glance which differences are
within noise. Regimes are shaded as a halo behind each point, in the regime's
colour: with several lines on one axis, bands across the whole plot would say
nothing about which line they belong to.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from batchbench.analysis.findings import Findings, PointFindings
from batchbench.analysis.findings.memory import MemoryBound
from batchbench.analysis.regimes import PEAK_SHARE
from batchbench.analysis.repeats import Estimate
from batchbench.reports import plots
from batchbench.reports.answer import layouts
from batchbench.reports.blocks import Block, Para, Plot, Section
from batchbench.reports.headline import BoundMark, HeadlinePoint, headline_svg
from batchbench.reports.model import ReportedRun, display_name
from batchbench.reports.series import group_series, series_labels
from batchbench.reports.svg import to_svg

#: Halo colour of each regime (the order they come in along a sweep).
REGIME_COLORS = {"under-utilised": "tab:blue", "sweet-spot": "tab:green", "memory-bound": "tab:orange",
                 "compute-saturated": "tab:purple", "saturated": "tab:red"}
_STYLES = ["-", "--", ":", "-."]

Value = Callable[[PointFindings], "tuple[float, float, float] | None"]


def _iv(key: str, scale: float = 1.0) -> Value:
    """A point's figure under ``key`` as (value, low, high), scaled (no interval: all three the value); None
    without the figure."""

    def get(point: PointFindings) -> tuple[float, float, float] | None:
        found = point.figure(key)
        if found is None:
            return None
        low = found.low if found.low is not None else found.value
        high = found.high if found.high is not None else found.value
        return found.value * scale, low * scale, high * scale

    return get


def _concurrency(point: PointFindings) -> tuple[float, float, float]:
    c = float(point.concurrency)
    return c, c, c


def _lines(findings: Findings) -> list[tuple[str, str, list[PointFindings]]]:
    """(engine, layout, its valid points by concurrency) for every line worth drawing."""
    out = []
    for engine, layout, f in layouts(findings):
        points = [p for p in f.points if p.valid]
        if points:
            out.append((engine, layout, sorted(points, key=lambda p: p.concurrency)))
    return out


def kv_plan_text(engine: str, layout: str, found: MemoryBound | None) -> str | None:
    """The planner's arithmetic behind a memory-bound finding, in one sentence (None: the finding has none)."""
    plan = found.kv_plan if found is not None else None
    if found is None or plan is None:
        return None
    return (f"{engine}, {layout}: {plan.kv_capacity_tokens:,} tokens of KV cache at {plan.kv_bytes_per_token:,} B "
            f"per token ({plan.kv_memory_bytes:,} B, blocks of {plan.block_size}); a sequence of the workload takes "
            f"{plan.sequence_tokens} tokens, so {plan.fit} fit at once and the cache fills from batch "
            f"{plan.memory_bound_from}; measured memory-bound from c={found.concurrency}.")


def _draw(ax: Axes, findings: Findings, colors: dict[str, str], x: Value, y: Value, *, label_points: bool,
          halos: bool) -> bool:
    """One line per engine and layout on ``ax``; False when no point had both figures."""
    drawn = False
    lines = _lines(findings)
    layouts = sorted({layout for _, layout, _ in lines})  # one style per layout, the same for every engine
    for engine, layout, points in lines:
        pairs = [(p, xv, yv) for p in points if (xv := x(p)) is not None and (yv := y(p)) is not None]
        if not pairs:
            continue
        drawn = True
        color = colors.get(engine, "C0")
        style = _STYLES[layouts.index(layout) % len(_STYLES)]
        xs, ys = [xv[0] for _, xv, _ in pairs], [yv[0] for _, _, yv in pairs]
        ax.errorbar(xs, ys, xerr=[[xv[0] - xv[1] for _, xv, _ in pairs], [xv[2] - xv[0] for _, xv, _ in pairs]],
                    yerr=[[yv[0] - yv[1] for _, _, yv in pairs], [yv[2] - yv[0] for _, _, yv in pairs]],
                    fmt=style + "o", color=color, markersize=5, capsize=2, linewidth=1.5, label=f"{engine} {layout}")
        for p, xv, yv in pairs:
            if halos and p.regime in REGIME_COLORS:
                ax.scatter([xv[0]], [yv[0]], s=260, color=REGIME_COLORS[p.regime], alpha=0.25, zorder=0,
                           linewidths=0)
            if label_points:
                ax.annotate(f"c={p.concurrency}", (xv[0], yv[0]), textcoords="offset points", xytext=(5, 4),
                            fontsize=7, color=color)
    if drawn:
        ax.grid(True, alpha=0.3)
    return drawn


def _legend(fig: Figure, ax: Axes, halos: bool) -> None:
    handles, _ = ax.get_legend_handles_labels()
    if halos:
        handles += [Patch(color=c, alpha=0.35, label=regime) for regime, c in REGIME_COLORS.items()]
    fig.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 0.95))


def latency_throughput(findings: Findings, colors: dict[str, str]) -> str | None:
    """TTFT p99 and TPOT p50 against output tokens/s, points labelled by batch size, regimes shaded."""
    fig = Figure(figsize=(11, 4.5))
    ax_ttft, ax_tpot = fig.subplots(1, 2)
    tok = _iv("output_tok_s")
    drawn = _draw(ax_ttft, findings, colors, tok, _iv("ttft_p99_s", 1000), label_points=True, halos=True)
    _draw(ax_tpot, findings, colors, tok, _iv("tpot_p50_s", 1000), label_points=True, halos=True)
    if not drawn:
        return None
    for ax, what in ((ax_ttft, "TTFT p99 (ms)"), (ax_tpot, "TPOT p50 (ms)")):
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(what)
        ax.set_xlim(left=0)
    fig.suptitle("Latency vs throughput (points: batch size c; halo: regime)")
    _legend(fig, ax_ttft, halos=True)
    return to_svg(fig)


def by_batch_size(findings: Findings, colors: dict[str, str]) -> str | None:
    """Output tokens/s and TTFT p99 against the batch size (concurrency)."""
    fig = Figure(figsize=(11, 4))
    ax_tok, ax_ttft = fig.subplots(1, 2)
    if not _draw(ax_tok, findings, colors, _concurrency, _iv("output_tok_s"), label_points=False, halos=False):
        return None
    _draw(ax_ttft, findings, colors, _concurrency, _iv("ttft_p99_s", 1000), label_points=False, halos=False)
    for ax, what in ((ax_tok, "output tokens/s"), (ax_ttft, "TTFT p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (concurrency)")
        ax.set_ylabel(what)
    fig.suptitle("Throughput and first-token latency by batch size")
    _legend(fig, ax_tok, halos=False)
    return to_svg(fig)


def per_user(findings: Findings, colors: dict[str, str], accelerators: dict[str, int]) -> str | None:
    """Tokens/s per accelerator against tokens/s per user (output tokens/s over the concurrency).

    The serving trade-off in one picture: up and to the right is better, and each batch size is a point on it.
    """
    def per_accelerator(point: PointFindings, engine: str) -> tuple[float, float, float] | None:
        found = _iv("output_tok_s")(point)
        n = max(1, accelerators.get(engine, 1))
        return None if found is None else (found[0] / n, found[1] / n, found[2] / n)

    def user(point: PointFindings) -> tuple[float, float, float] | None:
        found, c = _iv("output_tok_s")(point), point.concurrency
        return None if found is None else (found[0] / c, found[1] / c, found[2] / c)

    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    drawn = False
    for engine in sorted(findings.engines):
        one = dataclasses.replace(findings, engines={engine: findings.engines[engine]})
        drawn |= _draw(ax, one, colors, user, functools.partial(per_accelerator, engine=engine), label_points=True,
                       halos=False)
    if not drawn:
        return None
    ax.set_xlabel("output tokens/s per user")
    ax.set_ylabel("output tokens/s per accelerator")
    ax.set_title("Throughput per accelerator against speed per user")
    _legend(fig, ax, halos=False)
    return to_svg(fig)


def frontier(findings: Findings, colors: dict[str, str], accelerators: dict[str, int]) -> Plot | None:
    """The headline across engines: each engine's continuous-load curve as output tokens/s per accelerator against
    output tokens/s per user (its throughput over the batch size), intervals on both axes, the points that fail
    the SLO hollow, the pick starred, a TPOT limit drawn as the per-user speed it allows, and on a GPU each
    engine's limit on paper dashed. None with fewer than two engines or nothing to draw."""
    curves = {e: f.layouts["continuous"] for e, f in sorted(findings.engines.items()) if "continuous" in f.layouts}
    if len(curves) < 2:
        return None
    fig = Figure(figsize=(8, 4.8))
    ax = fig.add_subplot()
    drawn = False
    for engine, f in curves.items():
        n, color = max(1, accelerators.get(engine, 1)), colors.get(engine, "C0")
        points = [(p, tok) for p in sorted(f.valid_points, key=lambda p: p.concurrency)
                  if (tok := _iv("output_tok_s")(p)) is not None]
        if not points:
            continue
        drawn = True
        xs = [(t[0] / p.concurrency, t[1] / p.concurrency, t[2] / p.concurrency) for p, t in points]
        ys = [(t[0] / n, t[1] / n, t[2] / n) for _, t in points]
        ax.errorbar([x[0] for x in xs], [y[0] for y in ys], xerr=[[x[0] - x[1] for x in xs], [x[2] - x[0] for x in xs]],
                    yerr=[[y[0] - y[1] for y in ys], [y[2] - y[0] for y in ys]], fmt="-", color=color, capsize=2,
                    linewidth=1.5, label=engine)
        for (p, _), x, y in zip(points, xs, ys, strict=True):
            slo = f.slo_points.get(p.concurrency)
            hollow = slo is not None and slo.judgement != "meets"
            ax.plot([x[0]], [y[0]], "o", color=color, markersize=6, markerfacecolor="white" if hollow else color)
            ax.annotate(f"c={p.concurrency}", (x[0], y[0]), textcoords="offset points", xytext=(5, 4), fontsize=7,
                        color=color)
        pick = findings.pick
        if pick is not None and pick.engine == engine and pick.batch_size is not None:
            at = next(((x, y) for (p, _), x, y in zip(points, xs, ys, strict=True)
                       if p.concurrency == pick.batch_size), None)
            if at is not None:
                ax.plot([at[0][0]], [at[1][0]], "*", color=color, markersize=16, markeredgecolor="black",
                        label=f"the pick: {engine} at batch {pick.batch_size}")
        if f.limit is not None and f.limit.points:
            bound = sorted(f.limit.points.items())
            ax.plot([s.bound.output_tok_s / c for c, s in bound], [s.bound.output_tok_s / n for c, s in bound], "--",
                    color=color, linewidth=1, alpha=0.7, label=f"{engine}: limit on paper")
    if not drawn:
        return None
    tpot = next((o.limit_s for o in findings.slo.objectives if o.metric == "tpot"), None) \
        if findings.slo is not None else None
    if tpot:
        ax.axvline(1 / tpot, color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"TPOT SLO: {1 / tpot:,.0f} tokens/s per user", (1 / tpot, ax.get_ylim()[1]), fontsize=7,
                    rotation=90, va="top", ha="right", color="grey")
    ax.set_xlabel("output tokens/s per user (throughput over batch size)")
    ax.set_ylabel("output tokens/s per accelerator")
    ax.set_title("Every engine's continuous-load curve: up and to the right is better")
    ax.grid(True, alpha=0.3)
    _legend(fig, ax, halos=False)
    return Plot("The engines on one frontier: output tokens/s per accelerator against output tokens/s per user, one "
                "line per engine along its batch sizes (mean and 95% interval on both axes); hollow points do not "
                "clearly meet the SLO, the star is the pick" + (", the dotted line the TPOT SLO" if tpot else "")
                + ("; dashed, each engine's limit on paper" if any(f.limit is not None and f.limit.points
                                                                    for f in curves.values()) else "") + ".",
                to_svg(fig))


def accelerators(runs: list[ReportedRun]) -> dict[str, int]:
    """Accelerators each engine ran on: the GPUs its runs' environment lists (a CPU counts as one)."""
    out: dict[str, int] = {}
    for r in runs:
        gpus = r.environment.get("gpus")
        out[r.engine] = max(out.get(r.engine, 1), len(gpus) if isinstance(gpus, list) else 1)
    return out


def _memory_bound_points(findings: Findings, runs: list[ReportedRun]) -> list[list[ReportedRun]]:
    """The runs of the points where each engine and layout became memory-bound, for their KV and queue timelines:
    the finding's evidence, or (without one) the valid points classified memory-bound or saturated. A point's
    repeats are one list, drawn as one figure."""
    wanted: list[str] = []
    for _, _, f in layouts(findings):
        if f.memory_bound is not None:
            wanted += list(f.memory_bound.evidence)
        else:
            wanted += [i for p in f.points if p.valid and p.regime in ("memory-bound", "compute-saturated",
                                                                       "saturated") for i in p.run_ids]
    by_id = {r.run_id: r for r in runs}
    cited = [by_id[i] for i in dict.fromkeys(wanted) if i in by_id]
    return [[by_id[str(row["run_id"])] for row in s.rows] for s in group_series([r.to_row() for r in cited])]


def _point_title(point: list[ReportedRun]) -> str:
    first = point[0]
    repeats = f" ({len(point)} repeats)" if len(point) > 1 else ""
    return display_name(first.engine, first.batching_label, series_labels(first.to_row())) + repeats


def _triple(found: Estimate | None) -> tuple[float, float, float] | None:
    if found is None:
        return None
    return found.value, found.value if found.low is None else found.low, found.value if found.high is None \
        else found.high


def headlines(findings: Findings, colors: dict[str, str]) -> list[Block]:
    """One figure per engine for the answer: throughput against TTFT p99 along the curve its decisions were read
    from, the sweet spot ringed, the SLO's TTFT p99 limit drawn (where it has one) and the limit on paper beside
    the curve (where the runs' GPU has a row)."""
    limit = next((o.limit_s for o in findings.slo.objectives if o.metric == "ttft" and o.stat == "p99"), None) \
        if findings.slo is not None else None
    out: list[Block] = []
    for engine, e in sorted(findings.engines.items()):
        d = e.decisions
        curve = e.layouts.get(d.layout) if d.layout is not None else None
        if curve is None:
            continue
        points = [HeadlinePoint(p.concurrency, tok, ttft, p.valid) for p in curve.points
                  if (tok := _triple(p.figure("output_tok_s"))) is not None
                  and (ttft := _triple(p.figure("ttft_p99_s"))) is not None]
        shares = curve.limit.points if curve.limit is not None else {}
        bound = [BoundMark(c, s.bound.output_tok_s, s.bound.ttft_s) for c, s in sorted(shares.items())]
        setup = curve.limit.setup if curve.limit is not None else None
        svg = headline_svg(engine, points, sweet_spot=d.sweet_spot.concurrency if d.sweet_spot else None,
                           slo_ttft_p99_s=limit, color=colors.get(engine, "C0"), bound=bound,
                           bound_label=f"limit on paper, {setup.tp} x {setup.gpu}" if setup else "limit on paper")
        if svg is not None:
            out.append(Plot(f"{engine}, {d.layout}: output tokens/s against TTFT p99 by batch size (mean and 95% "
                            f"interval), the sweet spot ringed (the smallest batch within {1 - PEAK_SHARE:.0%} of the "
                            "most throughput)" + (", the SLO's TTFT p99 limit drawn" if limit else "")
                            + (f", and dashed the limit on paper ({setup.text()}): the output tokens/s ceiling at "
                               "each batch size, at the TTFT floor without queueing" if bound and setup else ""),
                            svg))
    return out


def figures_section(findings: Findings, runs: list[ReportedRun], colors: dict[str, str]) -> Section:
    """The figures behind the answer, drawn from the findings' points (means with their 95% intervals)."""
    sec = Section("Figures")
    drawn = [
        ("Latency vs throughput: TTFT p99 and TPOT p50 against output tokens/s, one line per engine and layout, "
         "points labelled by batch size, regimes shaded.", latency_throughput(findings, colors)),
        ("Output tokens/s and TTFT p99 against batch size.", by_batch_size(findings, colors)),
    ]
    if sum("continuous" in e.layouts for e in findings.engines.values()) < 2:  # else the answer's frontier shows it
        drawn.append(("Output tokens/s per accelerator against output tokens/s per user (per user: output tokens/s "
                      "over the concurrency).", per_user(findings, colors, accelerators(runs))))
    sec.blocks += [Plot(title, svg) for title, svg in drawn if svg is not None]
    timelines: list[Block] = [
        Plot(f"KV usage and queue depth over time at a memory-bound point, a line per run: {_point_title(point)}", svg)
        for point in _memory_bound_points(findings, runs)
        if (svg := plots.server_timeline(point, colors.get(point[0].engine))) is not None]
    arithmetic: list[Block] = [Para(text) for engine, layout, f in layouts(findings)
                               if (text := kv_plan_text(engine, layout, f.memory_bound)) is not None]
    if arithmetic:
        arithmetic.insert(0, Para("The KV planner's arithmetic (batchbench plan) on each served model's config.json, "
                                  "against the capacity the engine reported:"))
    if timelines or arithmetic:
        sec.blocks.append(Section("KV usage and queue depth at the memory-bound points", level=3,
                                  blocks=arithmetic + timelines))
    if not sec.blocks:
        sec.blocks.append(Para("No point has the figures to plot."))
    return sec
