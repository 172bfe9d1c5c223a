"""The report's figures over runs, as inline SVG (:func:`batchbench.reports.svg.to_svg`).

Figures are built on :class:`matplotlib.figure.Figure` directly, never through
pyplot, so no global backend is switched, nothing needs a display, and
building a report inside a test or the harness process leaves no state
behind. Captions name the runs in full; inside a figure a run is named only by
what sets it apart from the others drawn with it (:func:`short_names`), since
full names (every label, a design dict among them) made figures wider than
any screen.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from batchbench.measures.guardrails import KV_DANGER
from batchbench.reports.fmt import num
from batchbench.reports.model import ReportedRun
from batchbench.reports.svg import to_svg

#: The label that orders points along a latency-throughput curve, when the runs carry it.
POINT_LABEL = "concurrency"
_STYLES = ["-", "--", ":", "-."]


def engine_colors(runs: list[ReportedRun]) -> dict[str, str]:
    """One colour per engine (matplotlib's default cycle, C0..C9), the same in every figure of a report."""
    return {name: f"C{i % 10}" for i, name in enumerate(sorted({r.engine for r in runs}))}


def _point_order(run: ReportedRun) -> tuple[int, float, str]:
    c = run.run_labels.concurrency
    return (0, float(c), "") if c is not None else (1, 0.0, run.workload_name)


def _point_text(run: ReportedRun) -> str:
    c = run.run_labels.concurrency
    return f"c={c}" if c is not None else run.workload_name


def _series_of(points: list[ReportedRun]) -> dict[str, list[ReportedRun]]:
    """Group runs into lines: one per engine (and per other label, such as a layout).

    A line joins points that differ in the point label. When one engine has
    several runs at the same point (several batching configurations), its
    line splits by batching configuration so no line zigzags between them.
    """
    by_engine: dict[tuple[str, str], list[ReportedRun]] = defaultdict(list)
    for r in points:
        rest = " ".join(f"{k}={v}" for k, v in sorted(r.run_labels.items(), key=lambda kv: str(kv[0]))
                        if k != POINT_LABEL)
        by_engine[(r.engine, rest)].append(r)
    series: dict[str, list[ReportedRun]] = {}
    for (engine, rest), members in sorted(by_engine.items()):
        suffix = f" {rest}" if rest else ""
        batchings = sorted({r.batching_label for r in members})
        points_unique = len({_point_text(r) for r in members}) == len(members)
        if points_unique or len(batchings) == 1:
            tag = f" [{batchings[0]}]" if len(batchings) == 1 else ""
            series[f"{engine}{tag}{suffix}"] = members
        else:
            for b in batchings:
                series[f"{engine} [{b}]{suffix}"] = [r for r in members if r.batching_label == b]
    return series


def latency_throughput(runs: list[ReportedRun]) -> str | None:
    """Output tokens/s (x) against TTFT p99 (y): a line per engine, a point per run.

    Points are labelled with the run's concurrency (its ``concurrency`` label)
    and joined in its order, so the knee where latency climbs without more
    throughput shows; without that label a point is named after its workload.
    Hollow markers are partial runs. Latency goes log-scale when it spans
    more than 20x, as it does past the knee.
    """
    points = [r for r in runs if r.metric("output_token_throughput") is not None and r.metric("ttft_p99") is not None]
    if not points:
        return None
    colors = engine_colors(runs)
    style_of: dict[str, int] = defaultdict(int)
    fig = Figure(figsize=(9, 5))
    ax = fig.add_subplot()
    for label, members in _series_of(points).items():
        members.sort(key=_point_order)
        xs = [r.metric("output_token_throughput") or 0.0 for r in members]
        ys = [(r.metric("ttft_p99") or 0.0) * 1000 for r in members]
        engine = members[0].engine
        color = colors[engine]
        ax.plot(xs, ys, _STYLES[style_of[engine] % len(_STYLES)], color=color, label=label, linewidth=1.5)
        style_of[engine] += 1
        for r, x, y in zip(members, xs, ys):
            ax.plot([x], [y], "o", color=color, markerfacecolor="white" if r.partial else color, markersize=6)
            ax.annotate(_point_text(r) + (" (partial)" if r.partial else ""), (x, y), textcoords="offset points",
                        xytext=(5, 4), fontsize=8, color=color)
    ys_all = [(r.metric("ttft_p99") or 0.0) * 1000 for r in points]
    if min(ys_all) > 0 and max(ys_all) / min(ys_all) > 20:
        ax.set_yscale("log")
    ax.set_xlim(left=0)
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("TTFT p99 (ms)")
    ax.set_title("Latency vs throughput")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return to_svg(fig)


def short_names(runs: list[ReportedRun]) -> list[str]:
    """Each run as ``engine [batching]`` and the plain labels whose values differ among ``runs`` (a legend's
    names: the three repeats of one measurement are ``repeat=0``, ``repeat=1``, ``repeat=2``)."""
    keys = sorted({k for r in runs for k, v in r.run_labels.items() if isinstance(v, str | int | float | bool)
                   and len({str(o.run_labels.value(k)) for o in runs}) > 1}, key=str)
    return [" ".join([f"{r.engine} [{r.batching_label}]",
                      *(f"{k}={v}" for k in keys if (v := r.run_labels.value(k)) is not None)])
            + (" (partial)" if r.partial else "") for r in runs]


def _series(run: ReportedRun, name: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for s in run.samples:
        t, v = num(s.t), num(getattr(s, name))
        if t is not None and v is not None:
            xs.append(t)
            ys.append(v)
    order = sorted(range(len(xs)), key=xs.__getitem__)
    return [xs[i] for i in order], [ys[i] for i in order]


def _kv_axis(ax: Axes, lines: list[tuple[list[float], list[float], Any, str, str]]) -> None:
    """KV usage lines (times, values, colour, style, label) with the danger line and the zone above it filled."""
    for xs, ys, color, style, label in lines:
        ax.plot(xs, ys, style, color=color, linewidth=1.2, label=label)
        ax.fill_between(xs, ys, [KV_DANGER] * len(ys), where=[v >= KV_DANGER for v in ys], color="tab:red",
                        alpha=0.25, interpolate=True)
    if not lines:
        ax.text(0.5, 0.5, "engine exposes no KV usage", ha="center", va="center", transform=ax.transAxes,
                fontsize=8)
    ax.axhline(KV_DANGER, color="tab:red", linestyle="--", linewidth=1, label=f"{KV_DANGER:g} danger line")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("KV usage")


def _requests_ylim(ax: Axes, values: list[float]) -> None:
    """Room above the maximum and below zero, so a flat line at either is not hidden by the frame."""
    top = max([*values, 1.0]) * 1.15 + 0.5
    ax.set_ylim(-0.03 * top, top)


#: Height of one legend row at fontsize 7, in inches, with its spacing.
_LEGEND_ROW_IN = 0.18


def _legend_below(fig: Figure, handles: list[Any], labels: list[str], ncols: int = 3) -> None:
    """A legend under the axes, three runs to a row, the figure taller by its rows: a workload of many runs (a
    main job's repeats) has more rows than a fixed height holds, and the axes above collapsed to nothing."""
    if not handles:
        return
    fig.legend(handles, labels, fontsize=7, loc="outside lower center", ncols=min(len(handles), ncols), frameon=False)
    fig.set_figheight(fig.get_figheight() + _LEGEND_ROW_IN * math.ceil(len(handles) / ncols))


def workload_figure(runs: list[ReportedRun], colors: dict[str, Any]) -> str | None:
    """One compact figure per workload, a line per run: the TTFT CDF of its ok requests, its KV usage (with the
    danger line) and its requests waiting over time. What a per-run figure each used to show, at a fraction of
    the page: runs of one workload are a handful of repeats, which read best on one axis."""
    if not any(r.ttfts or r.samples for r in runs):
        return None
    fig = Figure(figsize=(10, 2.6), layout="constrained")
    ax_cdf, ax_kv, ax_wait = fig.subplots(1, 3)
    seen: dict[str, int] = defaultdict(int)
    kv_lines, waiting = [], []
    lo, hi = float("inf"), 0.0
    for r, name in zip(runs, short_names(runs)):
        style = _STYLES[seen[r.engine] % len(_STYLES)]
        seen[r.engine] += 1
        color = colors.get(r.engine)
        if data := [t * 1000 for t in r.ttfts or []]:
            ys = [(i + 1) / len(data) for i in range(len(data))]
            ax_cdf.step([data[0], *data], [0.0, *ys], style, where="post", color=color, linewidth=1.2, label=name)
            lo, hi = min(lo, data[0]), max(hi, data[-1])
        if (kv := _series(r, "kv_usage"))[0]:
            kv_lines.append((*kv, color, style, name))
        if (w := _series(r, "waiting"))[0]:
            ax_wait.plot(*w, style, color=color, linewidth=1.2)
            waiting += w[1]
    if lo > 0 and hi / lo > 20:
        ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("TTFT (ms)")
    ax_cdf.set_ylabel("fraction of ok requests")
    ax_cdf.set_ylim(0, 1.02)
    _kv_axis(ax_kv, kv_lines)
    ax_kv.set_xlabel("seconds since run start")
    if not waiting:
        ax_wait.text(0.5, 0.5, "engine exposes no queue depth", ha="center", va="center", transform=ax_wait.transAxes,
                     fontsize=8)
    _requests_ylim(ax_wait, waiting)
    ax_wait.set_ylabel("requests waiting")
    ax_wait.set_xlabel("seconds since run start")
    for ax in (ax_cdf, ax_kv, ax_wait):
        ax.tick_params(labelsize=8)  # no grid: a compact figure is read for its shape, and a grid is its bytes
    _legend_below(fig, *ax_cdf.get_legend_handles_labels())
    return to_svg(fig)


def slices_figure(runs: list[ReportedRun], colors: dict[str, Any]) -> str | None:
    """Output tokens/s and TTFT p99 per time window (``--slice``), a line per sliced run: warm-up, drift or a
    saturation that sets in within a run, which its whole-run figures average away."""
    sliced = [(r, name) for r, name in zip(runs, short_names(runs)) if r.slices]
    if not sliced:
        return None
    fig = Figure(figsize=(8, 2.6), layout="constrained")
    ax_tput, ax_ttft = fig.subplots(1, 2)
    seen: dict[str, int] = defaultdict(int)
    for r, name in sliced:
        style = _STYLES[seen[r.engine] % len(_STYLES)]
        seen[r.engine] += 1
        mids = [(w.start_s + w.end_s) / 2 for w in r.slices]
        ax_tput.plot(mids, [w.output_token_throughput for w in r.slices], style, marker=".",
                     color=colors.get(r.engine), linewidth=1.2, label=name)
        timed = [(m, w.ttft.p99 * 1000) for m, w in zip(mids, r.slices) if w.ttft is not None]
        if timed:
            ax_ttft.plot(*zip(*timed), style, marker=".", color=colors.get(r.engine), linewidth=1.2)
    ax_tput.set_ylabel("output tokens/s")
    ax_ttft.set_ylabel("TTFT p99 (ms), by send window")
    for ax in (ax_tput, ax_ttft):
        ax.set_xlabel("seconds since run start")
        ax.set_ylim(bottom=0)
        ax.tick_params(labelsize=8)
    _legend_below(fig, *ax_tput.get_legend_handles_labels())
    return to_svg(fig)


def _once(label: str, shown: set[str]) -> str:
    """``label`` the first time it is asked for, then matplotlib's "not in the legend" ("_")."""
    if label in shown:
        return "_"
    shown.add(label)
    return label


def server_timeline(runs: list[ReportedRun], color: Any) -> str | None:
    """KV usage (with the danger line) and queue depth (requests waiting and running) over the runs of one point
    (its repeats), a line per run, drawn alike: they are one measurement, and their spread is the noise."""
    shown: set[str] = set()
    kv_lines, counts = [], []
    fig = Figure(figsize=(7, 2.8), layout="constrained")
    ax_kv, ax_q = fig.subplots(1, 2)
    for r in runs:
        if (kv := _series(r, "kv_usage"))[0]:
            kv_lines.append((*kv, color, "-", _once("KV usage", shown)))
        # Waiting in black and dashed: no engine's colour (the default cycle's C1 is tab:orange, which vLLM's
        # "running" line took, so the two lines were one colour).
        for name, style, line_color in (("waiting", "--", "black"), ("running", "-", color)):
            xs, ys = _series(r, name)
            if xs:
                ax_q.plot(xs, ys, style, color=line_color, linewidth=1.2, label=_once(name, shown))
                counts += ys
    if not kv_lines and not counts:
        return None
    _kv_axis(ax_kv, kv_lines)
    ax_kv.legend(fontsize=7, loc="best")
    ax_q.set_ylabel("requests")
    _requests_ylim(ax_q, counts)
    if counts:
        ax_q.legend(fontsize=7, loc="best")
    for ax in (ax_kv, ax_q):
        ax.set_xlabel("seconds since run start")
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=8)
    return to_svg(fig)
