"""Production traces replayed as workloads: each request at its recorded offset, with its lengths, and (Mooncake)
the prompt blocks it shares with earlier requests.

Three layouts are read (``batchbench bench --trace FILE --trace-format F``):

- **mooncake** (kvcache-ai/Mooncake's FAST'25 traces, read by AIPerf, Dynamo and SGLang's bench as well): JSONL,
  ``{"timestamp": MS, "input_length": N, "output_length": M, "hash_ids": [..]}``; ``timestamp`` is milliseconds
  since the first request, and each hash id names one block of ``block_size`` prompt tokens (512 in the published
  traces), the last block possibly partial. Equal ids are equal token blocks, so two requests whose ``hash_ids``
  start alike share that prompt prefix, as their originals did.
- **burstgpt** (HPMLL/BurstGPT's CSV): ``Timestamp`` (seconds), ``Request tokens``, ``Response tokens`` (and
  ``Model``, ``Total tokens``, ``Log Type``, not used); rows with 0 response tokens (failed requests) are skipped
  and counted.
- **jsonl** (batchbench's own): ``{"t": SECONDS, "input_len": N, "output_len": M}``, optionally with
  ``"hash_ids"`` as in Mooncake.

Prompt tokens are seeded (the workload is identical for every engine): a hash id's block is drawn from its own
seeded stream, a request without hash ids gets tokens of its own. :func:`predicted_hit_rate` is the prefix-cache
hit rate the hash ids imply for an engine that caches whole blocks and never evicts: what the engine's own
counters can be checked against. Pure: reading a file and building requests, nothing started.
"""

from __future__ import annotations

import csv
import io
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, get_args

from batchbench.workload.datasets import jsonl_objects
from batchbench.workload.requests import FIRST_ORDINARY_TOKEN, Arrival, Lengths, Request, Workload, WorkloadSpec

TraceFormat = Literal["mooncake", "burstgpt", "jsonl"]
TRACE_FORMATS: tuple[str, ...] = get_args(TraceFormat)
#: Tokens a Mooncake hash id stands for in the published traces.
MOONCAKE_BLOCK_SIZE = 512

_BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
_JSONL_KEYS = {"mooncake": ("timestamp", "input_length", "output_length", "hash_ids"),
               "jsonl": ("t", "input_len", "output_len", "hash_ids")}


class TraceError(ValueError):
    """A trace that cannot be replayed, with the file and line named."""


@dataclass(frozen=True)
class TraceEntry:
    """One recorded request: when it came (seconds after the first), its lengths, its prompt blocks."""

    offset_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Trace:
    """The usable entries of a trace file, in arrival order, and the rows skipped (BurstGPT's failed requests)."""

    path: Path
    format: TraceFormat
    entries: tuple[TraceEntry, ...]
    skipped: int = 0

    @property
    def span_s(self) -> float:
        return self.entries[-1].offset_s - self.entries[0].offset_s

    @property
    def rate(self) -> float:
        """Requests per second the trace was recorded at: its gaps' mean rate."""
        return (len(self.entries) - 1) / self.span_s


def load(path: Path, fmt: TraceFormat) -> Trace:
    """Read ``path`` as ``fmt``; TraceError naming the line for anything it cannot use."""
    if fmt not in TRACE_FORMATS:
        raise TraceError(f"trace format {fmt!r}: expected one of {', '.join(TRACE_FORMATS)}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"trace {path}: cannot read it: {exc}") from None
    entries, skipped = (_burstgpt(path, text) if fmt == "burstgpt" else _jsonl(path, text, fmt))
    if len(entries) < 2:
        raise TraceError(f"trace {path}: {len(entries)} usable request(s); a replay needs at least two")
    entries.sort(key=lambda e: e.offset_s)  # stable: requests recorded at one instant keep their file order
    start = entries[0].offset_s
    entries = [TraceEntry(round(e.offset_s - start, 6), e.input_len, e.output_len, e.hash_ids) for e in entries]
    trace = Trace(Path(path), fmt, tuple(entries), skipped)
    if trace.span_s <= 0:
        raise TraceError(f"trace {path}: every request has the same timestamp, so it has no pace to replay; "
                         "use --dataset with --rate inf for a burst")
    return trace


def _jsonl(path: Path, text: str, fmt: TraceFormat) -> tuple[list[TraceEntry], int]:
    t_key, in_key, out_key, hash_key = _JSONL_KEYS[fmt]
    scale = 1e-3 if fmt == "mooncake" else 1.0  # Mooncake's timestamps are milliseconds
    entries = []
    for where, item in jsonl_objects(path, text, noun="trace", error=TraceError):
        if missing := [k for k in (t_key, in_key, out_key) if k not in item]:
            raise TraceError(f"trace {where}: no {', '.join(missing)} ({fmt} lines have "
                             f"{', '.join(_JSONL_KEYS[fmt])})")
        hash_ids = item.get(hash_key, [])
        if not (isinstance(hash_ids, list) and all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids)):
            raise TraceError(f"trace {where}: {hash_key} must be a list of integers")
        entries.append(TraceEntry(_offset(where, t_key, item[t_key]) * scale, _count(where, in_key, item[in_key]),
                                  _count(where, out_key, item[out_key]), tuple(hash_ids)))
    return entries, 0


def _burstgpt(path: Path, text: str) -> tuple[list[TraceEntry], int]:
    reader = csv.DictReader(io.StringIO(text))
    if missing := [c for c in _BURSTGPT_COLUMNS if c not in (reader.fieldnames or ())]:
        raise TraceError(f"trace {path}: not a BurstGPT CSV: no column {', '.join(missing)}")
    entries, skipped = [], 0
    for number, row in enumerate(reader, 2):  # line 1 is the header
        where = f"{path}:{number}"
        try:
            t, n_in, n_out = float(row["Timestamp"]), int(row["Request tokens"]), int(row["Response tokens"])
        except (TypeError, ValueError):
            raise TraceError(f"trace {where}: Timestamp, Request tokens and Response tokens must be numbers") from None
        if n_out == 0:  # BurstGPT logs failed requests with no response
            skipped += 1
            continue
        entries.append(TraceEntry(_offset(where, "Timestamp", t), _count(where, "Request tokens", n_in),
                                  _count(where, "Response tokens", n_out)))
    return entries, skipped


def _offset(where: str, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise TraceError(f"trace {where}: {key} must be a time of at least 0, not {value!r}")
    return float(value)


def _count(where: str, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(f"trace {where}: {key} must be a whole number of at least 1, not {value!r}")
    return value


def _check_blocks(trace: Trace, block_size: int) -> None:
    """Each entry's hash ids must cover its prompt: ceil(input / block) of them (the last block partial)."""
    for i, e in enumerate(trace.entries):
        if e.hash_ids and len(e.hash_ids) != math.ceil(e.input_len / block_size):
            raise TraceError(f"trace {trace.path}: request {i} has {len(e.hash_ids)} hash ids for {e.input_len} "
                             f"prompt tokens, which at {block_size} tokens a block need "
                             f"{math.ceil(e.input_len / block_size)}: give the trace's --trace-block-size")


def build_workload(trace: Trace, *, num_requests: int | None = None, block_size: int = MOONCAKE_BLOCK_SIZE,
                   seed: int = 0, vocab_size: int = 2048, max_model_len: int | None = None) -> Workload:
    """The trace's first ``num_requests`` entries (all: None) as a workload at the trace's own pace.

    Arrival kind ``timed`` (open loop, at ``Arrival.rate`` = the trace's mean rate); :func:`at_rate` time-scales
    it. Raises TraceError for a request that does not fit ``max_model_len`` or hash ids that do not cover it.
    """
    entries = trace.entries[:num_requests]
    _check_blocks(trace, block_size)
    blocks: dict[int, tuple[int, ...]] = {}

    def block(h: int) -> tuple[int, ...]:
        if h not in blocks:
            rng = random.Random(f"{seed}:trace-block:{h}")
            blocks[h] = tuple(rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(block_size))
        return blocks[h]

    rng_tok = random.Random(f"{seed}:tokens")
    stem = trace.path.stem
    requests = []
    for i, e in enumerate(entries):
        if max_model_len is not None and e.input_len + e.output_len > max_model_len:
            raise TraceError(f"trace {trace.path}: request {i}: prompt ({e.input_len} tokens) + output "
                             f"({e.output_len}) exceeds the model's max length {max_model_len}")
        if e.hash_ids:
            prompt = tuple(t for h in e.hash_ids for t in block(h))[:e.input_len]
        else:
            prompt = tuple(rng_tok.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(e.input_len))
        requests.append(Request(f"{stem}-{i:05d}", prompt, e.output_len, e.offset_s))
    plens, olens = [e.input_len for e in entries], [e.output_len for e in entries]
    rate = (len(entries) - 1) / entries[-1].offset_s if len(entries) > 1 and entries[-1].offset_s > 0 else trace.rate
    spec = WorkloadSpec(f"trace-{stem}", len(entries), prompt=Lengths.uniform(min(plens), max(plens)),
                        output=Lengths.uniform(min(olens), max(olens)), arrival=Arrival("timed", rate=rate),
                        seed=seed, vocab_size=vocab_size)
    return Workload(spec, tuple(requests))


def at_rate(workload: Workload, rate: float) -> Workload:
    """A trace workload time-scaled to ``rate`` requests/s on average: every gap by the same factor."""
    native = workload.arrival
    if native.kind != "timed":
        raise ValueError(f"at_rate() scales a trace's send times, not {native.kind!r} arrivals")
    factor = native.rate / rate
    spec = replace(workload.spec, arrival=Arrival("timed", rate=rate))
    return Workload(spec, tuple(Request(r.request_id, r.prompt_token_ids, r.max_tokens, round(r.arrival_s * factor, 6))
                                for r in workload.requests))


def predicted_hit_rate(entries: Iterable[TraceEntry], block_size: int, engine_block: int = 1) -> float | None:
    """Prompt tokens an ideal prefix cache serves over all prompt tokens, from the hash ids alone.

    A request hits the leading blocks earlier requests had (block content is a prefix chain: vLLM hashes a block
    with all before it), as many tokens of each as an earlier prompt held (a last block is often partial), up to
    the first block not held whole; in whole blocks of the engine's ``engine_block`` tokens, and never its last
    prompt token (the engine computes it to sample the first output token). The cache is taken to evict nothing.
    None when no entry has hash ids.
    """
    held: dict[tuple[int, int], int] = {}  # (the chain before a block, the block) -> most of its tokens seen
    hits = total = 0
    any_ids = False
    for e in entries:
        total += e.input_len
        if not e.hash_ids:
            continue
        any_ids = True
        chain, cached, whole = 0, 0, True
        for k, h in enumerate(e.hash_ids):
            link = (chain, h)
            here = min(block_size, e.input_len - k * block_size)  # this request's tokens of the block
            if whole:
                seen = held.get(link, 0)
                cached += min(seen, here)
                whole = seen >= block_size
            held[link] = max(held.get(link, 0), here)
            chain = hash(link)
        cached = min(cached, e.input_len - 1)
        hits += cached // engine_block * engine_block
    return hits / total if any_ids and total else None
