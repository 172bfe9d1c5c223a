"""What an engine's server says about itself, in engine-neutral units.

Each adapter maps its engine's own names (Prometheus or JSON) onto :class:`ServerMetrics`; nothing
above the adapters knows which engine's names they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ServerMetrics:
    """One scrape of an engine's server-side state.

    Counters (preemptions, rejections, completed) are cumulative since engine
    start, as Prometheus exposes them; ``None`` means the engine does not expose it.
    """

    t: float
    running: float | None = None
    waiting: float | None = None
    #: KV-cache usage as a fraction in [0, 1].
    kv_usage: float | None = None
    kv_capacity_tokens: float | None = None
    preemptions: float | None = None
    rejections: float | None = None
    #: Requests the engine itself counts as finished (every finish reason), cumulative.
    completed: float | None = None
    #: Prompt tokens looked up in the prefix cache, and those found there, cumulative (vLLM's
    #: ``prefix_cache_queries``/``prefix_cache_hits``): their increase over a run is its hit rate.
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    #: Waiting requests the scheduler passed over for a limit that frees by itself, the LoRA-adapter slots of a
    #: step among them (vLLM's ``num_requests_waiting_by_reason{reason="deferred"}``), rather than for room.
    waiting_deferred: float | None = None
    #: LoRA adapters with requests in the engine at its last logged step, as its output stream reported them
    #: (vLLM 0.32's ``lora_requests_info``: a request is counted from its first scheduled step, so in practice
    #: the adapters being served; never more than the engine's adapter slots).
    loras_active: list[str] | None = field(default=None, metadata={"was": "lora_adapters_active"})  # before v4
    #: Speculative decoding, cumulative: verification steps that checked a draft, the draft tokens proposed and
    #: those the model accepted (vLLM's ``spec_decode_num_drafts``/``num_draft_tokens``/``num_accepted_tokens``).
    #: Over a run, accepted/draft tokens is the acceptance rate, and 1 + accepted/drafts the tokens a drafted step
    #: emits on average.
    spec_drafts: float | None = None
    spec_draft_tokens: float | None = None
    spec_accepted_tokens: float | None = None


def prefix_cache_hit_rate(samples: Sequence[ServerMetrics]) -> float | None:
    """Prompt tokens the engine found in its prefix cache over those it looked up, between the first and the
    last sample that have both counters (None: fewer than two such samples, or nothing looked up)."""
    known = [s for s in samples if s.prefix_cache_queries is not None and s.prefix_cache_hits is not None]
    if len(known) < 2:
        return None
    queries = known[-1].prefix_cache_queries - known[0].prefix_cache_queries  # type: ignore[operator]
    hits = known[-1].prefix_cache_hits - known[0].prefix_cache_hits  # type: ignore[operator]
    return hits / queries if queries else None
