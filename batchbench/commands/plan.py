"""``batchbench plan --model MODEL``: how much KV cache, and so how many sequences, fit, before measuring anything.

MODEL is a config.json, a folder holding one, or the name of a config batchbench ships
(``batchbench plan --model list`` names them). From it the planner (:mod:`batchbench.analysis.planner`) works out,
step by step: the parameters and the weights' bytes per GPU, the KV bytes per token (GQA and MQA through
num_key_value_heads, MLA through kv_lora_rank + qk_rope_head_dim, sliding windows counted), the memory left
for KV per GPU (--memory x --memory-fraction - weights), the KV capacity in tokens and blocks, the most
sequences of --context tokens that fit, and with --prompt-len and --output-len where that workload
becomes memory-bound. Activations and engine buffers are not counted: an engine reports somewhat less.

With --gpu NAME (H100, H200, B200, A100, L40S, MI300X, ...; --memory then defaults to that GPU's) and the
workload's lengths, it adds the time half: the least decode step at each --concurrency (weights and KV over the
HBM bandwidth, FLOPs over the dense peak, TP's all-reduces over the link), hence the TPOT floor, the output
tokens/s ceiling and the TTFT floor per batch, which resource binds, and where decode would turn compute-bound
(the ridge) and memory-bound (KV). Peak datasheet figures: a measurement must never beat them.

Exit status: 0 planned; 2 a usage error (a config without a field the planner needs, an unknown dtype or GPU,
weights that do not fit, a --tp that does not divide the heads), with the reason.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from batchbench.analysis.accelerators import Accelerator
from batchbench.analysis.bounds import limits
from batchbench.analysis.planner import DEFAULT_CONTEXT, GiB, Plan, PlanError, plan
from batchbench.analysis.theory import DTYPE_BYTES, dtype_bytes
from batchbench.commands.plan_limits import DEFAULT_LEVELS, limit_lines, limits_json
from batchbench.core.exits import EXIT_OK, EXIT_USAGE
from batchbench.core.option_values import concurrency_list, positive_int
from batchbench.core.options import Command, option
from batchbench.fixtures import model_configs_dir, shipped_model_dir
from batchbench.options import accelerator

#: Units --memory takes: decimal (GB) and binary (GiB), as GPU vendors and engines use both.
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def memory_size(text: str) -> int:
    """``80GiB`` -> 85899345920, ``141GB`` -> 141000000000 (a bare number is bytes): one GPU's memory."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = UNITS.get(match.group(2).lower() or "b") if match else None
    if match is None or unit is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 80GiB or 141GB (units {', '.join(UNITS)}), "
                                         f"not {text!r}")
    value = int(Decimal(match.group(1)) * unit)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, not {text!r}")
    return value


def dtype(text: str) -> str:
    if text.lower() not in DTYPE_BYTES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}: one of {', '.join(DTYPE_BYTES)}")
    return text.lower()


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.9, not {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 1, not {text}")
    return value


def shipped_models() -> dict[str, Path]:
    """The shipped configs by name (the file's stem), e.g. ``Llama-3-70B``."""
    return {path.stem: path for path in sorted(model_configs_dir().glob("*.json"))}


def load_config(model: str) -> tuple[str, dict[str, Any]]:
    """(a name to show, the config) for a config.json, a folder holding one, a shipped model (``tiny-llama``,
    ``llama-3-8b-shaped``: what ``--model`` serves) or a shipped config's name (case-insensitive); a PlanError
    naming what was looked for otherwise."""
    path = shipped_model_dir(model) or Path(model)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise PlanError(f"no config.json in the folder {model!r}")
    if path.is_file():
        name = path.parent.name if path.name == "config.json" else path.stem
    else:
        by_name = {name.lower(): (name, p) for name, p in shipped_models().items()}
        if model.lower() not in by_name:
            raise PlanError(f"no config.json at {model!r} and no shipped config of that name "
                            f"(shipped: {', '.join(shipped_models())})")
        name, path = by_name[model.lower()]
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read {path.name} of {model!r}: {exc}") from None
    if not isinstance(config, dict):
        raise PlanError(f"{path.name} of {model!r} is not a JSON object")
    return name, config


#: One GPU's memory planned for without ``--memory`` or ``--gpu``: an 80 GiB H100's or A100's.
DEFAULT_MEMORY = 80 * GiB


@dataclass(frozen=True)
class PlanArgs:
    """``batchbench plan``'s options, each declared once."""

    model: str = option("--model", required=True, metavar="CONFIG_OR_NAME",
                        help="a config.json, a folder holding one, or a shipped config's name ('list' names them)")
    memory: int | None = option("--memory", type=memory_size, metavar="SIZE",
                                help=f"one GPU's memory, e.g. 80GiB or 141GB (default {DEFAULT_MEMORY // GiB}GiB, or "
                                     "the --gpu's memory)")
    memory_fraction: float = option(
        "--memory-fraction", default=0.9, type=fraction, metavar="F",
        help="share of the memory the engine may use for weights and KV cache (default %(default)g)")
    weight_dtype: str = option("--weight-dtype", default="bf16", type=dtype, metavar="DTYPE",
                               help="the weights' dtype: bf16, fp16, fp8, fp32 (default %(default)s)")
    kv_dtype: str = option("--kv-dtype", default="bf16", type=dtype, metavar="DTYPE",
                           help="the KV cache's dtype: bf16, fp16, fp8, fp8_e4m3, fp8_e5m2, fp32 (default %(default)s)")
    tp: int = option("--tp", default=1, type=positive_int, metavar="N",
                     help="tensor-parallel GPUs (default %(default)s)")
    context: int | None = option(
        "--context", type=positive_int, metavar="TOKENS",
        help=f"the context length sequences are planned at (max_model_len; default {DEFAULT_CONTEXT}, or the model's "
             "max_position_embeddings if shorter)")
    prompt_len: int | None = option(
        "--prompt-len", type=positive_int, metavar="P",
        help="a workload's prompt tokens (with --output-len: where it becomes memory-bound)")
    output_len: int | None = option("--output-len", type=positive_int, metavar="O",
                                    help="a workload's output tokens")
    block_size: int = option("--block-size", default=16, type=positive_int, metavar="TOKENS",
                             help="tokens per KV-cache block (default %(default)s, vLLM's on a GPU)")
    gpu: Accelerator | None = option(
        "--gpu", type=accelerator, metavar="NAME",
        help="a GPU of the accelerators table (H100, H100-PCIe, H200, B200, A100, L40S, MI300X): add the time bounds "
             "(needs --prompt-len and --output-len)")
    concurrency: tuple[int, ...] | None = option(
        "--concurrency", type=concurrency_list, metavar="LIST",
        help=f"with --gpu: the batch sizes of the curve on paper, e.g. 1,8,32 (default "
             f"{','.join(map(str, DEFAULT_LEVELS))})")
    json: bool = option("--json", default=False, action="store_true",
                        help="print the plan as JSON instead of the steps")


def _gib(n: int) -> str:
    """Bytes in the largest binary unit that keeps a figure above 1 (weights of a tiny model are MiB, not 0 GiB)."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n} B"


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return str(n)


def kv_line(p: Plan) -> str:
    """The KV bytes per token as the product it is, and what one GPU holds of it."""
    kv = p.kv
    size = dtype_bytes(p.kv_dtype)
    if kv.latent_dim is not None:
        return (f"MLA: {kv.layers} layers x {kv.latent_dim} (kv_lora_rank + qk_rope_head_dim) x {size} B "
                f"({p.kv_dtype}) = {p.kv_bytes_per_token:,} B; the latent is not split by head, so each of the "
                f"{p.tp} GPU(s) holds all of it: {p.kv_bytes_per_token_per_gpu:,} B")
    return (f"{kv.attention}: 2 (K, V) x {kv.layers} layers x {kv.kv_heads} KV heads x {kv.head_dim} head_dim x "
            f"{size} B ({p.kv_dtype}) = {p.kv_bytes_per_token:,} B; per GPU ({kv.kv_heads_per_gpu} KV heads of "
            f"{kv.kv_heads} on each of {p.tp}): {p.kv_bytes_per_token_per_gpu:,} B")


def lines(p: Plan) -> list[str]:
    """The plan, one step a line, each with the arithmetic that gives it."""
    par, kv = p.parameters, p.kv
    out = [
        f"{p.model}: {p.tp} GPU(s) of {_gib(p.memory_bytes)}, {p.weight_dtype} weights, {p.kv_dtype} KV cache, "
        f"blocks of {p.block_size} tokens",
        f"1 parameters   ~{_count(par.total)} = embeddings {_count(par.embedding)} + lm_head {_count(par.lm_head)} "
        f"+ attention {_count(par.attention)} + MLP {_count(par.mlp)} + norms {_count(par.norms)}",
        f"2 weights      {_count(par.total)} x {dtype_bytes(p.weight_dtype)} B ({p.weight_dtype}) = "
        f"{_gib(p.weight_bytes_total)}; / {p.tp} GPU(s) = {_gib(p.weight_bytes)} per GPU",
        f"3 KV per token {kv_line(p)}",
    ]
    if kv.sliding_window is not None:
        out.append(f"  sliding window: {kv.windowed_layers} of {kv.layers} layers hold at most {kv.sliding_window:,} "
                   "tokens of a sequence; a sequence's footprint is its tokens averaged over the layers")
    out += [
        f"4 KV memory    {_gib(p.memory_bytes)} x {p.memory_fraction:g} = {_gib(p.usable_bytes)} - "
        f"{_gib(p.weight_bytes)} weights = {_gib(p.kv_memory_bytes)} per GPU",
        f"5 capacity     {p.kv_memory_bytes:,} B / {p.kv_bytes_per_token_per_gpu:,} B per token = "
        f"{p.kv_capacity_tokens:,} tokens in whole blocks = {p.kv_capacity_blocks:,} blocks of {p.block_size}",
        f"6 sequences    one of {p.context:,} tokens holds {p.sequence_tokens:,} tokens of KV "
        f"({p.sequence_tokens // p.block_size:,} blocks): {p.max_sequences:,} fit at once",
    ]
    if p.workload_sequence_tokens is not None:
        out.append(f"7 workload     {p.prompt_len}+{p.output_len} tokens hold {p.workload_sequence_tokens:,} tokens of "
                   f"KV (the last output token is never fed back; whole blocks): {p.workload_fit:,} fit at once, "
                   f"memory-bound from {p.memory_bound_from:,} concurrent sequences")
    if p.problem is not None:
        out.append(f"nothing is left for the KV cache: {p.problem}")
    elif p.max_sequences == 0:
        out.append(f"not one sequence of {p.context:,} tokens fits: a shorter --context, more GPUs or less weight")
    out.append("not counted: activations, CUDA graphs and other engine buffers taken from the same memory, so an "
               "engine reports somewhat less")
    return out


def main(args: PlanArgs) -> int:
    """``batchbench plan``."""
    if args.model == "list":
        print("\n".join(shipped_models()))
        return EXIT_OK
    if args.concurrency is not None and args.gpu is None:
        print("batchbench plan: --concurrency is the curve's batch sizes, which need a --gpu", file=sys.stderr)
        return EXIT_USAGE
    if args.gpu is not None and (args.prompt_len is None or args.output_len is None):
        print("batchbench plan: --gpu needs --prompt-len and --output-len: a step's time depends on the context it "
              "reads", file=sys.stderr)
        return EXIT_USAGE
    memory = args.memory if args.memory is not None else args.gpu.memory_bytes if args.gpu else DEFAULT_MEMORY
    try:
        name, config = load_config(args.model)
        result = plan(config, model=name, memory_bytes=memory, memory_fraction=args.memory_fraction,
                      weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype, tp=args.tp, context=args.context,
                      block_size=args.block_size, prompt_len=args.prompt_len, output_len=args.output_len)
        bounds = None if args.gpu is None or args.prompt_len is None or args.output_len is None else limits(
            config, args.gpu, model=name, memory_bytes=memory, memory_fraction=args.memory_fraction,
            weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype, tp=args.tp, context=args.context,
            block_size=args.block_size, prompt_len=args.prompt_len, output_len=args.output_len)
    except PlanError as exc:
        print(f"batchbench plan: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if bounds is None:
        print(json.dumps(result.to_dict(), indent=2) if args.json else "\n".join(lines(result)))
        return EXIT_OK
    curve = bounds.curve(args.concurrency or DEFAULT_LEVELS)
    if args.json:
        print(json.dumps(limits_json(bounds, curve), indent=2))
    else:
        print("\n".join(lines(result) + limit_lines(bounds, curve)))
    return EXIT_OK


COMMAND = Command("plan", "KV memory planner: from a model's config, the KV cache and the sequences that fit in a "
                  "GPU's memory", __doc__, PlanArgs, main)
