"""Metrics computed from :class:`~batchbench.core.records.RequestRecord` lists.

Everything here is plain Python (no numpy) so the suite can summarise a run
on any machine the harness runs on, and every definition is written out in
one place: engines report these numbers under the same names but compute
them differently, and a comparison is only fair if one definition is applied
to every engine's raw timings.

Conventions:

- Only successful (``ok``) requests enter latency distributions: a failed
  request has no meaningful latency, but it is counted, and it counts against
  goodput.
- Throughputs divide by the run's wall-clock ``duration_s``, not by the sum
  of per-request latencies, so they reflect what the engine sustained.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from batchbench.core.records import RequestRecord
from batchbench.measures.gpu import Energy

__all__ = [
    "Distribution",
    "LoraSummary",
    "SteadyState",
    "Summary",
    "itl_samples",
    "jain_index",
    "latencies",
    "mean_decoding",
    "meets_slos",
    "percentile",
    "steady_state",
    "summarize",
    "tpot",
    "ttft_by_bucket",
    "ttft_by_turn",
]


# --------------------------------------------------------------------------- percentiles


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (``q`` in [0, 100]).

    Linear interpolation between closest ranks, the same as numpy's default
    (``method='linear'``), including numpy's two-sided interpolation, so the
    numbers match what other benchmark tools (vLLM's, SGLang's) print for the
    same samples. Raises :class:`ValueError` on empty input, NaN values, or
    ``q`` outside [0, 100].
    """
    if not 0.0 <= q <= 100.0:  # also rejects NaN
        raise ValueError(f"percentile q must be in [0, 100], not {q!r}")
    if len(values) == 0:
        raise ValueError("percentile of an empty sequence is undefined")
    ordered = sorted(values)
    if any(map(math.isnan, ordered)):
        raise ValueError("percentile of values containing NaN is undefined")
    pos = (q / 100.0) * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    t = pos - lo
    a, b = ordered[lo], ordered[hi]
    diff = b - a
    # numpy's _lerp: interpolate from the nearer end so t == 1 gives b exactly
    # and the result stays within [a, b] despite rounding.
    return b - diff * (1.0 - t) if t >= 0.5 else a + diff * t


@dataclass(frozen=True, slots=True)
class Distribution:
    """Summary statistics of one latency sample set, as reported in results."""

    count: int
    mean: float
    min: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution | None:
        """Summarise ``values``; None for no values, so "no data" never reads as a zero latency."""
        data = list(values)
        if not data:
            return None
        return cls(
            count=len(data),
            mean=math.fsum(data) / len(data),
            min=min(data),
            p50=percentile(data, 50),
            p90=percentile(data, 90),
            p99=percentile(data, 99),
            max=max(data),
        )


# --------------------------------------------------------------------------- per-request


def itl_samples(record: RequestRecord) -> list[float]:
    """Inter-token latencies of one request, time to first token excluded.

    Engines stream several tokens per chunk under load (speculative decoding,
    detokenizer batching, network coalescing). Counting such a chunk as one
    "token" would understate token counts and overstate per-token latency, so
    a chunk of ``k`` tokens arriving ``g`` seconds after the previous chunk
    contributes ``k`` samples of ``g / k``. The first chunk contributes
    nothing (its delay is TTFT), so the samples sum to the time between the
    first and last chunk.
    """
    times, tokens = record.chunk_times, record.chunk_tokens
    if len(times) != len(tokens):
        raise ValueError(
            f"request {record.request_id}: {len(times)} chunk times but {len(tokens)} chunk token counts"
        )
    samples: list[float] = []
    for i in range(1, len(times)):
        k = tokens[i]
        if k < 1:
            raise ValueError(f"request {record.request_id}: chunk {i} carries {k} tokens; recorded chunks carry >= 1")
        samples.extend([(times[i] - times[i - 1]) / k] * k)
    return samples


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first: (last chunk - first chunk) / (output tokens - 1).

    Uses the engine's own token count (:attr:`RequestRecord.output_tokens`),
    so chunking does not change it. None for a failed request, for fewer than
    two output tokens (nothing to average), and for fewer than two chunks
    (the response was not streamed token by token, so the decode time is
    unobserved; reporting 0 would fake a perfect TPOT).
    """
    n = record.output_tokens
    if not record.ok or n < 2 or len(record.chunk_times) < 2:
        return None
    return (record.chunk_times[-1] - record.chunk_times[0]) / (n - 1)


def meets_slos(record: RequestRecord, ttft_slo_s: float | None, tpot_slo_s: float | None) -> bool:
    """Whether a request counts towards goodput: ok, and within every SLO given.

    A TTFT SLO needs an observed TTFT. A TPOT SLO is met vacuously by a
    request with fewer than two output tokens (there is no TPOT to violate),
    but a longer request whose TPOT was not observed does not meet it.
    """
    if not record.ok:
        return False
    if ttft_slo_s is not None:
        ttft = record.ttft_s
        if ttft is None or ttft > ttft_slo_s:
            return False
    if tpot_slo_s is not None and record.output_tokens >= 2:
        t = tpot(record)
        if t is None or t > tpot_slo_s:
            return False
    return True


# --------------------------------------------------------------------------- run summary


@dataclass(frozen=True)
class SteadyState:
    """A closed loop's steady state: from its first completion (the opening burst, every client's first prompt
    prefilled at once, is over) to the first completion after its last send (from there fewer than all clients
    have a request in flight: the drain). Throughput counts the tokens that arrived in that window over its
    length; the latencies are those of the requests sent in it, so neither the ramp-up nor the drain, which a
    short run would weigh heavily, bends the curve. The whole run's figures stay beside it in the summary."""

    start_s: float
    end_s: float
    #: Output tokens whose chunks arrived in the window, over its length.
    output_token_throughput: float
    #: Requests sent in the window (their latencies are the distributions below).
    requests: int
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2e: Distribution | None
    #: Time to the first token of the answer, after any reasoning (None in documents written before it was stored).
    ttfo: Distribution | None = None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def latencies(records: Sequence[RequestRecord], steady: SteadyState | None, metric: str) -> list[float]:
    """The samples a run's distribution of ``metric`` (``ttft``, ``ttfo``, ``tpot``, ``e2e``, ``itl``) is of: its
    successful requests sent in its steady state where it has one, else all of them; ITL gives a sample per token
    (:func:`itl_samples`), the others one per request. Pooling these over repeats is how a point's tail
    percentile gets enough samples to bound it."""
    ok = [r for r in records if r.ok and r.chunk_times]
    if steady is not None:
        ok = [r for r in ok if steady.start_s <= r.sent_s <= steady.end_s]
    return _samples(ok, metric)


#: Each request's own latency of a metric (ITL, a sample per token, is :func:`itl_samples`).
_PER_REQUEST: dict[str, Callable[[RequestRecord], float | None]] = {
    "ttft": lambda r: r.ttft_s, "ttfo": lambda r: r.ttfo_s, "tpot": tpot, "e2e": lambda r: r.e2e_s}


def _samples(requests: Sequence[RequestRecord], metric: str) -> list[float]:
    """The samples of ``metric`` these (successful) requests give."""
    if metric == "itl":
        return [x for r in requests for x in itl_samples(r)]
    return _present(_PER_REQUEST[metric](r) for r in requests)


def steady_state(records: Sequence[RequestRecord]) -> SteadyState | None:
    """The steady state of a closed loop's records (times from the run's start); None where the run has none: no
    completion after the first, or a window of no length (a run no longer than one round of its clients)."""
    ok = [r for r in records if r.ok and r.chunk_times]
    if len(ok) < 2:
        return None
    # A request's completion is its last token (an ok request's ``done_s``).
    start = min(r.chunk_times[-1] for r in ok)
    last_send = max(r.sent_s for r in records)
    end = min((done for r in ok if (done := r.chunk_times[-1]) > last_send), default=None)
    if end is None or not end > start:
        return None
    tokens = sum(n for r in ok for t, n in zip(r.chunk_times, r.chunk_tokens) if start < t <= end)
    sent = [r for r in ok if start <= r.sent_s <= end]
    return SteadyState(
        start_s=start, end_s=end, output_token_throughput=tokens / (end - start), requests=len(sent),
        **{metric: Distribution.of(_samples(sent, metric)) for metric in ("ttft", "tpot", "itl", "e2e", "ttfo")})


@dataclass(frozen=True)
class Summary:
    """Everything reported for one run of one workload on one engine."""

    duration_s: float
    requests: int
    ok: int
    failed: int
    #: Failed requests by ``error_kind`` (``"unknown"`` when none was recorded).
    failures: dict[str, int]
    rejected: int
    #: rejected / requests; None for a run with no requests.
    rejection_rate: float | None
    ttft: Distribution | None
    tpot: Distribution | None
    #: Pooled over the tokens of all ok requests (long requests weigh more).
    itl: Distribution | None
    e2e: Distribution | None
    e2e_from_schedule: Distribution | None
    schedule_lag: Distribution | None
    request_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    #: Requests that were ok and met every SLO given.
    good: int = 0
    goodput: float = 0.0
    #: good / requests (failed requests count as missing the SLO); None for no requests.
    goodput_fraction: float | None = None
    #: Time-averaged number of requests streaming tokens (see :func:`mean_decoding`); None in summaries
    #: read from documents written before it was stored.
    mean_decoding: float | None = None
    #: Gaps between consecutive chunks, one sample per chunk whatever it carried: what ``vllm bench serve``
    #: reports as ITL. Beside :attr:`itl` (per token) it shows when an engine sends several tokens per chunk.
    #: Both use the same percentile method (numpy's linear). None in documents written before it was stored.
    itl_per_chunk: Distribution | None = None
    #: Multi-turn sessions: TTFT of each turn ("1", "2", ...; see :func:`ttft_by_turn`). None for a run without
    #: sessions, and in documents written before it was stored.
    ttft_by_turn: dict[str, Distribution | None] | None = None
    #: Per LoRA adapter (by name), for a run whose requests name adapters; None otherwise.
    loras: dict[str, LoraSummary] | None = field(default=None, metadata={"was": "adapters"})
    #: Jain's index over the adapters' :attr:`LoraSummary.request_speed`: 1 when every adapter's requests
    #: are served alike, down to 1/n when one adapter gets all the service. None without two adapters.
    lora_fairness: float | None = field(default=None, metadata={"was": "adapter_fairness"})
    #: The GPUs' energy over the run and what it bought (tokens per joule, joules per request, cost per million
    #: output tokens), with why a figure is empty (:func:`batchbench.measures.gpu.energy_of`; the runner adds it
    #: from the run's GPU telemetry). None: not measured (a summary computed from records alone, older documents).
    energy: Energy | None = None
    #: A closed loop's steady state (:class:`SteadyState`); None for other arrivals, for a run too short to have
    #: one, and in documents written before it was stored.
    steady: SteadyState | None = None

    @property
    def curve_throughput(self) -> float:
        """Output tokens/s as a point of the latency-throughput curve: the steady state's where the run has one
        (a closed loop), else the whole run's."""
        return self.steady.output_token_throughput if self.steady is not None else self.output_token_throughput
    #: Time to the first token of the answer, after any reasoning (:attr:`RequestRecord.ttfo_s`): the TTFT of a
    #: stream that does not reason. None in documents written before it was stored.
    ttfo: Distribution | None = None
    #: Reasoning tokens per ok request, for a run whose streams reasoned (a chat stream's ``reasoning`` deltas,
    #: the engine's own count where it gives one); None where no stream did.
    reasoning_tokens: Distribution | None = None
    #: Prompt tokens per request, over the ok requests the engine counted, as sent (the workload's) and as the
    #: engine counted them (its usage): on a chat endpoint the difference is what the chat template added. None
    #: where the engine counted none.
    prompt_tokens_sent: Distribution | None = None
    prompt_tokens_engine: Distribution | None = None


def _present(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def summarize(
    records: Sequence[RequestRecord],
    *,
    duration_s: float,
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
    closed_loop: bool = False,
) -> Summary:
    """Summarise one run.

    ``duration_s`` is the run's wall-clock length (first scheduled send to
    last completion, as the runner measured it); throughputs divide by it.
    Prompt tokens come from the engine's usage report when present, else the
    workload's prompt length, so engines that add special tokens are charged
    for them. SLOs of None are not checked. ``closed_loop``: the records are a
    closed loop's, whose :class:`SteadyState` is given too.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, not {duration_s!r}")
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    failures = Counter(r.error_kind or "unknown" for r in failed)
    rejected = sum(1 for r in records if r.error_kind == "rejected")
    n = len(records)
    loras = by_lora(records, duration_s)

    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    counted = [r for r in ok if r.prompt_tokens is not None]
    good = sum(1 for r in ok if meets_slos(r, ttft_slo_s, tpot_slo_s))

    return Summary(
        duration_s=duration_s,
        requests=n,
        ok=len(ok),
        failed=len(failed),
        failures=dict(sorted(failures.items())),
        rejected=rejected,
        rejection_rate=rejected / n if n else None,
        ttft=Distribution.of(_present(r.ttft_s for r in ok)),
        tpot=Distribution.of(_present(tpot(r) for r in ok)),
        itl=Distribution.of(s for r in ok for s in itl_samples(r)),
        e2e=Distribution.of(_present(r.e2e_s for r in ok)),
        e2e_from_schedule=Distribution.of(_present(r.e2e_from_schedule_s for r in ok)),
        schedule_lag=Distribution.of(r.schedule_lag_s for r in ok),
        request_throughput=len(ok) / duration_s,
        output_token_throughput=output_tokens / duration_s,
        total_token_throughput=(prompt_tokens + output_tokens) / duration_s,
        ttft_slo_s=ttft_slo_s,
        tpot_slo_s=tpot_slo_s,
        good=good,
        goodput=good / duration_s,
        goodput_fraction=good / n if n else None,
        mean_decoding=mean_decoding(ok, duration_s),
        itl_per_chunk=Distribution.of(b - a for r in ok for a, b in itertools.pairwise(r.chunk_times)),
        ttft_by_turn=({str(turn): d for turn, d in by_turn.items()} if (by_turn := ttft_by_turn(records)) else None),
        loras=loras,
        lora_fairness=lora_fairness(loras),
        steady=steady_state(records) if closed_loop else None,
        ttfo=Distribution.of(_present(r.ttfo_s for r in ok)),
        reasoning_tokens=Distribution.of(float(r.reasoning_tokens) for r in ok if r.reasoning_tokens is not None),
        prompt_tokens_sent=Distribution.of(float(r.prompt_len) for r in counted),
        prompt_tokens_engine=Distribution.of(float(r.prompt_tokens or 0) for r in counted),
    )


def mean_decoding(records: Iterable[RequestRecord], duration_s: float) -> float:
    """Time-averaged number of requests between their first and last streamed chunk.

    The batch occupancy seen from the client, the same for every engine: a
    continuous batcher starts decoding a new request within a step of a slot
    freeing, so under a closed loop of N this stays near N; a static batcher
    (or static waves) leaves a finished request's slot empty until the whole
    batch is done. Time in the queue and in prefill is not decoding, so it is
    not counted. (Sum of decode spans) / duration, by Little's law.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, not {duration_s!r}")
    return sum(r.chunk_times[-1] - r.chunk_times[0] for r in records if r.chunk_times) / duration_s


# --------------------------------------------------------------------------- LoRA adapters


@dataclass(frozen=True)
class LoraSummary:
    """One LoRA adapter's share of a run: what its requests got."""

    requests: int
    ok: int
    ttft: Distribution | None
    #: The adapter's output tokens over the run's duration.
    output_token_throughput: float
    #: Mean over its ok requests of output tokens / latency from the scheduled send: the speed the adapter's
    #: users see, queueing included. With a fixed traffic split every adapter's tokens over the run are set by
    #: the split, so throughput cannot show an adapter held back; how long its requests took does.
    request_speed: float | None


def by_lora(records: Sequence[RequestRecord], duration_s: float) -> dict[str, LoraSummary] | None:
    """Per-adapter summaries of the records that name an adapter; None when none does."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        if r.lora is not None:
            groups.setdefault(r.lora, []).append(r)
    if not groups:
        return None
    result = {}
    for name, group in sorted(groups.items()):
        ok = [r for r in group if r.ok]
        speeds = [r.output_tokens / e2e for r in ok if (e2e := r.e2e_from_schedule_s)]
        result[name] = LoraSummary(
            requests=len(group), ok=len(ok), ttft=Distribution.of(_present(r.ttft_s for r in ok)),
            output_token_throughput=sum(r.output_tokens for r in ok) / duration_s,
            request_speed=math.fsum(speeds) / len(speeds) if speeds else None)
    return result


def lora_fairness(loras: dict[str, LoraSummary] | None) -> float | None:
    """Jain's index of the adapters' request speeds; None with fewer than two adapters that have one."""
    speeds = [a.request_speed for a in (loras or {}).values() if a.request_speed is not None]
    return jain_index(speeds) if len(speeds) >= 2 else None


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index, (sum x)^2 / (n * sum x^2), of non-negative allocations, not all zero.

    1 when all are equal, 1/n when one has everything; the same for any common scale of the values
    (Jain, Chiu and Hawe, DEC-TR-301, 1984). Written out because it is one line.
    """
    if not values:
        raise ValueError("Jain's index of no values is undefined")
    if any(v < 0 or math.isnan(v) for v in values):
        raise ValueError(f"Jain's index needs non-negative allocations, not {list(values)}")
    # Scaled by the largest first: the index is scale-invariant, and squares of tiny or huge values would
    # underflow or overflow.
    top = max(values)
    if top == 0:
        raise ValueError("Jain's index of all-zero allocations is undefined")
    scaled = [v / top for v in values]
    return min(1.0, math.fsum(scaled) ** 2 / (len(scaled) * math.fsum(x * x for x in scaled)))


# --------------------------------------------------------------------------- batch-size buckets


def _bucket_labels(edges: Sequence[int]) -> list[str]:
    if not edges:
        raise ValueError("edges must not be empty")
    if any(b <= a for a, b in itertools.pairwise(edges)):
        raise ValueError(f"edges must be strictly increasing, not {tuple(edges)}")
    labels = [str(lo) if hi - 1 == lo else f"{lo}-{hi - 1}" for lo, hi in itertools.pairwise(edges)]
    labels.append(f"{edges[-1]}+")
    return labels


def ttft_by_bucket(
    records: Sequence[RequestRecord],
    bucket_of: Callable[[RequestRecord], int],
    edges: Sequence[int],
) -> dict[str, Distribution | None]:
    """TTFT distributions of ok requests, grouped by the batch size each request met.

    TTFT is where batching hurts first (a new request waits for, or shares a
    step with, the batch in flight), so it is reported per batch-size bucket.
    ``edges`` (1, 2, 4, 8, 16) give buckets '1', '2-3', '4-7', '8-15', '16+'.
    Every bucket appears, None when empty, so tables have stable columns. A
    batch size below the first edge is a caller error (the edges must cover
    every size) and raises :class:`ValueError` rather than being dropped.
    """
    labels = _bucket_labels(edges)
    groups: dict[str, list[float]] = {label: [] for label in labels}
    for r in records:
        ttft = r.ttft_s
        if not r.ok or ttft is None:
            continue
        size = bucket_of(r)
        if size < edges[0]:
            raise ValueError(f"request {r.request_id}: batch size {size} is below the first edge {edges[0]}")
        index = sum(1 for e in edges if e <= size) - 1
        groups[labels[index]].append(ttft)
    return {label: Distribution.of(values) for label, values in groups.items()}


# --------------------------------------------------------------------------- multi-turn sessions


def ttft_by_turn(records: Sequence[RequestRecord]) -> dict[int, Distribution | None]:
    """TTFT distributions of ok requests by their turn in a conversation (1, 2, ...), in turn order.

    A later turn carries the whole conversation so far, so its prefill grows with the turn unless the
    engine keeps the history's KV: the turn is the axis on which that shows. Every turn any record has
    appears, None when none of its requests succeeded (a turn that always failed is not a fast turn).
    Empty for records without sessions.
    """
    groups: dict[int, list[float]] = {}
    for r in records:
        if r.turn is None:
            continue
        values = groups.setdefault(r.turn, [])
        if r.ok and r.ttft_s is not None:
            values.append(r.ttft_s)
    return {turn: Distribution.of(groups[turn]) for turn in sorted(groups)}
