"""A run's metrics over windows of its time: fixed ones (``--slice SECONDS``: warm-up, drift and saturation within
one run, which its whole-run percentiles average away; AIPerf's time slices answer the same question) or a staged
load's stages (``bench --stages``: each stage on its own).

Each window holds what happened in it, on the run's clock (0 = the first scheduled send): the requests sent in it
and their TTFT (a request belongs to the window it was sent in, where its latency was decided), the output tokens
that arrived in it (throughput is those over the window's length, so a window splits a long request's tokens as
they came), the inter-token gaps that ended in it, the requests that ended and failed in it, and the server's KV
usage and queue as its samples in the window read them. The last window is as long as what is left of the run.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from batchbench.core.records import RequestRecord
from batchbench.core.server_metrics import ServerMetrics
from batchbench.measures.metrics import Distribution


@dataclass(frozen=True)
class Slice:
    """One window of a run."""

    start_s: float
    end_s: float
    #: Requests sent in the window, and those of them that failed.
    sent: int
    failed: int
    #: Requests whose stream ended in the window (their last token, or their failure).
    finished: int
    #: Output tokens that arrived in the window, over its length.
    output_tokens: int
    output_token_throughput: float
    #: TTFT of the requests sent in the window; inter-token gaps that ended in it.
    ttft: Distribution | None
    itl: Distribution | None
    #: The server's samples in the window: KV-cache usage (fraction) and requests waiting, mean and highest.
    kv_usage_mean: float | None
    kv_usage_max: float | None
    waiting_mean: float | None
    waiting_max: float | None
    #: What the window is, where it is more than its times (a stage: ``rate=2:60s``).
    label: str | None = None


def time_slices(records: Sequence[RequestRecord], samples: Sequence[ServerMetrics], *, width_s: float,
                duration_s: float) -> list[Slice]:
    """``duration_s`` of run cut into windows of ``width_s`` (the last shorter); empty for a run of no length."""
    if not width_s > 0:
        raise ValueError(f"a slice must be longer than 0 s, not {width_s!r}")
    if not duration_s > 0:
        return []
    n = math.ceil(duration_s / width_s - 1e-9)
    return windows(records, samples, [k * width_s for k in range(n)] + [duration_s])


def stage_windows(records: Sequence[RequestRecord], samples: Sequence[ServerMetrics], *, edges: Sequence[float],
                  labels: Sequence[str], duration_s: float) -> list[Slice]:
    """One window per stage (``edges``: each stage's start, then the last one's end); the last stage's window runs
    on to the run's end, so the requests still in flight when the sends stop are its, where they were sent."""
    cut = [*edges[:-1], max(edges[-1], duration_s)]
    return [replace(w, label=label) for w, label in zip(windows(records, samples, cut), labels)]


def windows(records: Sequence[RequestRecord], samples: Sequence[ServerMetrics],
            edges: Sequence[float]) -> list[Slice]:
    """The run between consecutive ``edges`` (seconds from its start, increasing): a record or sample belongs to
    the window its time falls in, one before the first edge to the first, one after the last to the last."""
    n = len(edges) - 1
    if n < 1:
        return []

    def index(t: float) -> int:
        return min(max(bisect.bisect_right(edges, t) - 1, 0), n - 1)

    sent, failed, finished, tokens = [0] * n, [0] * n, [0] * n, [0] * n
    ttfts: list[list[float]] = [[] for _ in range(n)]
    gaps: list[list[float]] = [[] for _ in range(n)]
    kv: list[list[float]] = [[] for _ in range(n)]
    waiting: list[list[float]] = [[] for _ in range(n)]
    for r in records:
        k = index(r.sent_s)
        sent[k] += 1
        if not r.ok:
            failed[k] += 1
        elif r.ttft_s is not None:
            ttfts[k].append(r.ttft_s)
        if r.done_s is not None:
            finished[index(r.done_s)] += 1
        for t, count in zip(r.chunk_times, r.chunk_tokens):
            tokens[index(t)] += count
        if r.ok:
            for a, b in itertools.pairwise(r.chunk_times):
                gaps[index(b)].append(b - a)
    for s in samples:
        if edges[0] <= s.t <= edges[-1]:
            k = index(s.t)
            if s.kv_usage is not None:
                kv[k].append(s.kv_usage)
            if s.waiting is not None:
                waiting[k].append(s.waiting)
    out = []
    for k in range(n):
        start, end = edges[k], edges[k + 1]
        out.append(Slice(
            start_s=round(start, 6), end_s=round(end, 6), sent=sent[k], failed=failed[k], finished=finished[k],
            output_tokens=tokens[k], output_token_throughput=tokens[k] / (end - start),
            ttft=Distribution.of(ttfts[k]), itl=Distribution.of(gaps[k]),
            kv_usage_mean=_mean(kv[k]), kv_usage_max=max(kv[k], default=None),
            waiting_mean=_mean(waiting[k]), waiting_max=max(waiting[k], default=None)))
    return out


def _mean(values: list[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None
