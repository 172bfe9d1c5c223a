"""What an engine's server says about itself, in engine-neutral units.

Each adapter maps its engine's own names (Prometheus or JSON) onto :class:`ServerMetrics`; nothing
above the adapters knows which engine's names they were.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


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
    #: Speculative decoding, cumulative: verification steps that checked a draft, the draft tokens proposed and
    #: those the model accepted (vLLM's ``spec_decode_num_drafts``/``num_draft_tokens``/``num_accepted_tokens``).
    #: Over a run, accepted/draft tokens is the acceptance rate, and 1 + accepted/drafts the tokens a drafted step
    #: emits on average.
    spec_drafts: float | None = None
    spec_draft_tokens: float | None = None
    spec_accepted_tokens: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
