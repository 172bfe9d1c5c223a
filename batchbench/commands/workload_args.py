"""The user's own workload's options, as ``bench`` and ``capacity`` take them: lengths, a dataset or a trace, size,
arrivals, SLO.

:func:`add_workload_arguments` registers them, each default read from
:class:`~batchbench.experiment.workload.WorkloadArgs`, which they are parsed into;
:func:`~batchbench.experiment.workload.prepare_workload` turns that into the workload sent, every rule checked
before an engine starts.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from batchbench.commands.common import parsed_by, positive_int, positive_seconds
from batchbench.experiment.workload import Workers, WorkloadArgs
from batchbench.measures.slo import Slo
from batchbench.workload import stages, traces
from batchbench.workload.lora import LoraSpec, TrafficSplit
from batchbench.workload.requests import (
    Lengths,
    ThinkTime,
)


def add_stages_argument(parser: argparse.ArgumentParser) -> None:
    """``--stages``: ``bench``'s alone (``capacity`` searches a rate; the stages would set it)."""
    parser.add_argument("--stages", type=_stages_option, default=None, metavar="STAGES",
                        help="staged load in one run: rate=R:SECONDS held, ramp=FROM-TO:SECONDS linear, comma-"
                             "separated (e.g. rate=2:60s,ramp=2-8:30s,rate=8:60s); Poisson sends, each stage reported "
                             "on its own and the run as a whole")


def _stages_option(text: str) -> tuple[stages.Stage, ...]:
    try:
        return stages.parse_stages(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_number(text: str) -> float:
    """A number more than 0 (a level, a gamma shape, a tolerance)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number more than 0, not {text}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def workers_option(text: str) -> Workers:
    """``N`` or ``auto`` processes of this host, or ``ray:N`` actors on a Ray cluster."""
    if text.startswith("ray:"):
        return Workers(positive_int(text[4:]), "ray")
    return Workers(None if text == "auto" else positive_int(text))


def add_workload_arguments(parser: argparse.ArgumentParser, *, slo_required: bool = False) -> None:
    """Lengths or dataset, size, warm-up, arrivals, SLO, repeats: the options ``bench`` and ``capacity`` share."""
    lengths = "a number (fixed), uniform:LOW:HIGH, lognormal:MEDIAN:SIGMA[:LOW:HIGH] or mixed:SHORT:LONG:PERIOD"
    parser.add_argument("--input-len", type=parsed_by(Lengths), default=None, metavar="LENGTHS",
                        help=f"prompt tokens: {lengths} (default 128; not with --dataset)")
    parser.add_argument("--output-len", type=parsed_by(Lengths), default=None, metavar="LENGTHS",
                        help="output tokens, same forms (default 128; with --dataset it replaces the dataset's own)")
    parser.add_argument("--dataset", type=Path, default=None, metavar="FILE",
                        help='prompts: JSONL ({"prompt": "text"} or {"prompt_token_ids": [...]}, optional '
                             '"output_len") or ShareGPT JSON; used in file order, cycled')
    parser.add_argument("--trace", type=Path, default=None, metavar="FILE",
                        help="replay a production trace: each request at its recorded offset with its lengths "
                             "(and Mooncake's shared prompt blocks); --rate time-scales it to those mean rates, "
                             "--trace-speed by a factor (default: as recorded)")
    parser.add_argument("--trace-format", choices=traces.TRACE_FORMATS, default=WorkloadArgs.trace_format,
                        help="mooncake (JSONL: timestamp ms, input_length, output_length, hash_ids), burstgpt "
                             "(CSV) or jsonl (t s, input_len, output_len[, hash_ids]) (default %(default)s)")
    parser.add_argument("--trace-speed", type=positive_number, default=None, metavar="X",
                        help="replay the trace X times as fast as recorded (default 1; not with --rate)")
    parser.add_argument("--trace-block-size", type=positive_int, default=WorkloadArgs.trace_block_size, metavar="N",
                        help=f"prompt tokens per hash id (default {traces.MOONCAKE_BLOCK_SIZE}, the published "
                             "Mooncake traces')")
    parser.add_argument("--tokenizer", default=None, metavar="PATH_OR_HF_ID",
                        help="the served model's tokenizer: for text datasets, chat prompts, and text prompts where a "
                             "server refuses token ids (default: --model's, or the embedded model's)")
    parser.add_argument("--num-requests", type=positive_int, default=None,
                        help="requests per run (default: the profile's, raised to what the --slo percentiles need, "
                             "e.g. 200 for a p99; with --duration, a ceiling)")
    parser.add_argument("--duration", type=positive_seconds, default=None, metavar="SECONDS",
                        help="send requests for this long, then let those in flight finish")
    parser.add_argument("--turns", type=positive_int, default=WorkloadArgs.turns, metavar="N",
                        help="multi-turn conversations of N turns: each turn's prompt is the conversation so far "
                             "(previous prompt, an answer-length stand-in, a new --input-len message), sent once "
                             "the previous answer is complete; --concurrency is conversations at once; the "
                             "report adds TTFT by turn (default 1: single requests)")
    parser.add_argument("--think-time", type=parsed_by(ThinkTime), default=None, metavar="SECONDS|exp:MEAN",
                        help="with --turns: the pause between an answer and the next turn, fixed or exponential "
                             "with that mean (default 0)")
    parser.add_argument("--warmup", type=non_negative_int, default=WorkloadArgs.warmup, metavar="N",
                        help="requests sent before each run the same way, not recorded (default %(default)s)")
    parser.add_argument("--arrival", choices=["poisson", "gamma"], default=WorkloadArgs.arrival,
                        help="inter-arrival times of --rate runs (default %(default)s)")
    parser.add_argument("--burstiness", type=positive_number, default=WorkloadArgs.burstiness, metavar="SHAPE",
                        help="gamma shape of --arrival gamma: 1 is Poisson, below 1 burstier (default %(default)g)")
    parser.add_argument("--slo", type=parsed_by(Slo), required=slo_required, default=None, metavar="OBJECTIVES",
                        help="e.g. ttft_p99=200ms,tpot_p99=50ms: each run is checked, and goodput counts the "
                             "requests within the TTFT/TPOT limits")
    parser.add_argument("--repeats", type=positive_int, default=WorkloadArgs.repeats,
                        help=f"runs of each level (default {WorkloadArgs.repeats})")
    parser.add_argument("--seed", type=int, default=WorkloadArgs.seed)
    parser.add_argument("--scrape-interval", type=positive_seconds, default=WorkloadArgs.scrape_interval,
                        metavar="SECONDS", help=f"how often the engine's metrics are read (default "
                                                f"{WorkloadArgs.scrape_interval:g}; see batchbench run --help)")
    parser.add_argument("--request-timeout", type=positive_seconds, default=None, metavar="SECONDS",
                        help="per-request deadline over the whole stream (default: the profile's); also how long a "
                             "request of the engine's warm-up may go without a word before the start is given up")
    parser.add_argument("--workers", type=workers_option, default=Workers(), metavar="N|auto|ray:N",
                        help="load-generator processes, each with its own event loop (default 1: this one); auto "
                             "chooses per level from the expected chunk rate (batchbench/load/workers.py); ray:N "
                             "places N workers on a Ray cluster, spread over its nodes (load/ray_workers.py, "
                             "needs pip install 'batchbench[ray]')")
    parser.add_argument("--ray-address", default=None, metavar="ADDR",
                        help="with --workers ray:N: the Ray cluster's address (host:port of its head's GCS, or "
                             "ray://host:10001 for Ray Client); default: $RAY_ADDRESS where set (ray job submit "
                             "sets it), else a Ray started on this host for the command")
    parser.add_argument("--slice", type=positive_seconds, default=None, metavar="SECONDS",
                        help="also each run's metrics over windows of this length (throughput, TTFT/ITL, errors, "
                             "KV usage, queue): warm-up, drift and saturation within a run")
    parser.add_argument("--no-report", action="store_true", help="write results only")
    parser.add_argument("--lora-adapters", dest="loras", type=LoraSpec.parse_list, default=(), metavar="ADAPTERS",
                        help="LoRA adapters served beside the model, requests shared among them: ranks to make with "
                             "seeded random weights (8,16,32,64; for the embedded or a local model) or NAME=PATH "
                             "of PEFT adapters; with --batching max_loras=N,max_lora_rank=R")
    parser.add_argument("--lora-split", type=parsed_by(TrafficSplit), default=TrafficSplit(), metavar="SPLIT",
                        help="traffic across --lora-adapters: even (default), skewed[:SHARE] (the first takes "
                             "SHARE, default 0.6) or W1:W2:...")


