"""The report's figures, rendered to PNG bytes with matplotlib's Agg canvas.

Figures are built on :class:`matplotlib.figure.Figure` directly, never through
pyplot, so no global backend is switched, nothing needs a display, and
building a report inside a test or the harness process leaves no state
behind. PNG metadata is dropped so the same runs give the same bytes.
"""

from __future__ import annotations

import io
from collections import defaultdict
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from batchbench.guardrails import KV_DANGER
from batchbench.reports.fmt import num
from batchbench.reports.model import Run

#: The label that orders points along a latency-throughput curve, when the runs carry it.
POINT_LABEL = "concurrency"
_DPI = 100


def to_png(fig: Figure) -> bytes:
    """The figure as PNG bytes, without metadata (the same figure gives the same bytes)."""
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def engine_colors(runs: list[Run]) -> dict[str, str]:
    """One colour per engine (matplotlib's default cycle, C0..C9), the same in every figure of a report."""
    return {name: f"C{i % 10}" for i, name in enumerate(sorted({r.engine for r in runs}))}


def _point_order(run: Run) -> tuple[int, float, str]:
    value = run.labels.get(POINT_LABEL)
    n = num(value)
    return (0, n, "") if n is not None else (1, 0.0, str(value))


def _point_text(run: Run) -> str:
    if POINT_LABEL in run.labels:
        return f"c={run.labels[POINT_LABEL]}"
    return run.workload_name


def _series_of(points: list[Run]) -> dict[str, list[Run]]:
    """Group runs into lines: one per engine (and per other label, such as a layout).

    A line joins points that differ in the point label. When one engine has
    several runs at the same point (several batching configurations), its
    line splits by batching configuration so no line zigzags between them.
    """
    by_engine: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for r in points:
        rest = " ".join(f"{k}={v}" for k, v in sorted(r.labels.items(), key=lambda kv: str(kv[0]))
                        if k != POINT_LABEL)
        by_engine[(r.engine, rest)].append(r)
    series: dict[str, list[Run]] = {}
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


def latency_throughput(runs: list[Run]) -> bytes | None:
    """Output tokens/s (x) against TTFT p99 (y): a line per engine, a point per run.

    Points are labelled with the run's concurrency (``labels["concurrency"]``)
    and joined in its order, so the knee where latency climbs without more
    throughput shows; without that label a point is named after its workload.
    Hollow markers are partial runs. Latency goes log-scale when it spans
    more than 20x, as it does past the knee.
    """
    points = [r for r in runs if r.metric("output_token_throughput") is not None and r.metric("ttft_p99") is not None]
    if not points:
        return None
    colors = engine_colors(runs)
    styles = ["-", "--", ":", "-."]
    style_of: dict[str, int] = defaultdict(int)
    fig = Figure(figsize=(9, 5))
    ax = fig.add_subplot()
    for label, members in _series_of(points).items():
        members.sort(key=_point_order)
        xs = [r.metric("output_token_throughput") or 0.0 for r in members]
        ys = [(r.metric("ttft_p99") or 0.0) * 1000 for r in members]
        engine = members[0].engine
        color = colors[engine]
        ax.plot(xs, ys, styles[style_of[engine] % len(styles)], color=color, label=label, linewidth=1.5)
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
    return to_png(fig)


def ttft_cdf(runs: list[Run], title: str, colors: dict[str, Any]) -> bytes | None:
    """Empirical CDF of the TTFTs of ok requests, one line per run (runs of one workload)."""
    shown = [r for r in runs if r.ttfts]
    if not shown:
        return None
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    styles = ["-", "--", ":", "-."]
    seen: dict[str, int] = defaultdict(int)
    lo, hi = float("inf"), 0.0
    for r in shown:
        data = [t * 1000 for t in r.ttfts or []]
        n = len(data)
        ys = [(i + 1) / n for i in range(n)]
        ls = styles[seen[r.engine] % len(styles)]
        seen[r.engine] += 1
        ax.step([data[0], *data], [0.0, *ys], ls, where="post", color=colors.get(r.engine), linewidth=1.5,
                label=r.display_name() + (" (partial)" if r.partial else ""))
        lo, hi = min(lo, data[0]), max(hi, data[-1])
    if lo > 0 and hi / lo > 20:
        ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of ok requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"TTFT CDF: {title}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return to_png(fig)


def _series(run: Run, name: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for s in run.samples:
        t, v = num(s.t), num(getattr(s, name))
        if t is not None and v is not None:
            xs.append(t)
            ys.append(v)
    order = sorted(range(len(xs)), key=xs.__getitem__)
    return [xs[i] for i in order], [ys[i] for i in order]


def _timeline_axis(ax: Axes, xs: list[float], ys: list[float], color: Any, label: str, style: str = "-") -> None:
    ax.plot(xs, ys, style, color=color, linewidth=1.5, label=label)
    ax.grid(True, alpha=0.3)


def server_timeline(run: Run, color: Any) -> bytes | None:
    """KV usage (with the danger line) and queue depth over the run, from the scraped samples."""
    kv_t, kv = _series(run, "kv_usage")
    w_t, waiting = _series(run, "waiting")
    r_t, running = _series(run, "running")
    if not kv and not waiting and not running:
        return None
    fig = Figure(figsize=(8, 4.5))
    ax_kv, ax_q = fig.subplots(2, 1, sharex=True)
    if kv:
        _timeline_axis(ax_kv, kv_t, kv, color, "KV usage")
        ax_kv.fill_between(kv_t, kv, [KV_DANGER] * len(kv), where=[v >= KV_DANGER for v in kv],
                           color="tab:red", alpha=0.25, interpolate=True)
    else:
        ax_kv.text(0.5, 0.5, "engine exposes no KV usage", ha="center", va="center", transform=ax_kv.transAxes)
    ax_kv.axhline(KV_DANGER, color="tab:red", linestyle="--", linewidth=1,
                  label=f"{KV_DANGER:g} danger line")
    ax_kv.set_ylim(0, 1.05)
    ax_kv.set_ylabel("KV usage")
    ax_kv.legend(fontsize=8, loc="upper left")
    if waiting:
        # Black and dashed: no engine's colour (the default cycle's C1 is tab:orange, which vLLM's
        # "running" line took, so the two lines were one colour).
        _timeline_axis(ax_q, w_t, waiting, "black", "waiting", "--")
    if running:
        _timeline_axis(ax_q, r_t, running, color, "running")
    ax_q.set_ylabel("requests")
    ax_q.set_xlabel("seconds since run start")
    peak = max([*waiting, *running, 1.0])
    ax_q.set_ylim(0, peak * 1.15 + 0.5)  # headroom so a flat line at the maximum is not hidden by the frame
    if waiting or running:
        ax_q.legend(fontsize=8, loc="upper left")
    title = run.display_name() + (" (partial)" if run.partial else "")
    ax_kv.set_title(f"{title}: {run.workload_name}", fontsize=10)
    return to_png(fig)
