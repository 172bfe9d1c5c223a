"""The bound on paper of one measured run: which GPU row, model, lengths, TP and dtypes its results document gives.

A measured curve can only be set beside the physical limit (:mod:`batchbench.analysis.bounds`) when the run says
what it ran on. The GPU is the row (:mod:`batchbench.analysis.accelerators`) of the device NVML named in the
header's ``gpus`` (or, in a document older than that, the ``nvidia-smi`` names of its environment), unless one is
given (``--gpu NAME``: an engine at a URL, whose GPUs the client's NVML cannot see), to the report or, recorded in
``gpus.declared``, to the run. The model is the served
model's config.json; the lengths are the workload's mean prompt and output (a step's time is linear in the context
it reads, so the mean is the bound of the mean); TP and the dtypes are the engine's server arguments where it
names them, else 1 and the config's ``torch_dtype``. The cache may use all of the GPU's memory: an engine's memory
share is not in the document, and the most generous cache keeps the bound a bound. Where any input is missing,
:func:`run_limit` says which in a sentence instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchbench.analysis.accelerators import (
    Accelerator,
    UnknownAccelerator,
    accelerator_for_device_name,
    find_accelerator,
)
from batchbench.analysis.bounds import Limits, limits
from batchbench.analysis.theory import DTYPE_BYTES
from batchbench.results.document import RunDocument
from batchbench.workload.requests import TokenCounts

__all__ = ["RunLimit", "Setup", "run_limit"]

#: Server flags that name the tensor-parallel degree (vLLM, SGLang, TGI, TensorRT-LLM's serve) and the dtypes.
TP_FLAGS = ("--tensor-parallel-size", "-tp", "--tp", "--tp-size", "--tp_size", "--num-shard")
DTYPE_FLAGS = ("--dtype",)
KV_DTYPE_FLAGS = ("--kv-cache-dtype",)


@dataclass(frozen=True)
class Setup:
    """What a run's bound assumes, so a reader can redo it with ``batchbench plan``."""

    gpu: str
    #: Where the GPU row came from: "NVML: NVIDIA H100 80GB HBM3" or "--gpu H100".
    gpu_source: str
    model: str
    tp: int
    weight_dtype: str
    kv_dtype: str
    prompt_len: int
    output_len: int

    def text(self) -> str:
        """``1 x H100 SXM (NVML: NVIDIA H100 80GB HBM3), tiny-llama, bf16 weights, bf16 KV, 16 + 10 tokens``."""
        return (f"{self.tp} x {self.gpu} ({self.gpu_source}), {self.model}, {self.weight_dtype} weights, "
                f"{self.kv_dtype} KV, {self.prompt_len} + {self.output_len} tokens")

    def command(self) -> str:
        """The ``batchbench plan`` line that prints the same bound with its arithmetic."""
        return (f"batchbench plan --model {self.model} --gpu '{self.gpu}' --tp {self.tp} --weight-dtype "
                f"{self.weight_dtype} --kv-dtype {self.kv_dtype} --memory-fraction 1 --prompt-len {self.prompt_len} "
                f"--output-len {self.output_len}")


@dataclass(frozen=True)
class RunLimit:
    """A run's setup and the limits it gives; two runs with one setup are one bound (equal and hashed by setup)."""

    setup: Setup
    limits: Limits = field(compare=False, repr=False)


def _flag(argv: Sequence[str], names: Sequence[str]) -> str | None:
    """The value of the last of ``names`` in ``argv`` (``--flag V`` or ``--flag=V``), as the server reads it."""
    found = None
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in names:
            found = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return found


def _dtype(value: Any) -> str | None:
    """A dtype the bounds know (``bfloat16`` is ``bf16``), or None (``auto``, absent, unknown)."""
    if not isinstance(value, str) or value.lower() not in DTYPE_BYTES:
        return None
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8_e4m3",
            "float8_e5m2": "fp8_e5m2"}.get(value.lower(), value.lower())


def _device_names(doc: RunDocument) -> tuple[list[str], str | None]:
    """The names of the GPUs the run sampled, else those its environment lists; or why there are none."""
    selection = doc.header.gpus
    if selection is not None and selection.devices:
        return [d.name for d in selection.devices], None
    listed = doc.header.environment.get("gpus")
    names = [g["name"] for g in listed if isinstance(g, dict) and isinstance(g.get("name"), str)] \
        if isinstance(listed, list) else []
    if names:
        return names, None
    why = selection.unavailable if selection is not None and selection.unavailable else "no GPU in its environment"
    at_url = doc.header.engine.mode == "url"
    return [], (f"no GPU row: the run names no GPU ({why}); the engine is at a URL: --gpu NAME gives its GPU"
                if at_url else f"no GPU row: the engine ran on this host's CPU ({why})")


def _gpu(doc: RunDocument, given: Accelerator | None) -> tuple[Accelerator | None, str]:
    """The run's GPU row and where it came from, or None and why there is none."""
    if given is not None:
        return given, f"--gpu {given.name}"
    declared = doc.header.gpus.declared if doc.header.gpus is not None else None
    if declared is not None:
        try:
            return find_accelerator(declared), f"--gpu {declared}, given to the run"
        except UnknownAccelerator as exc:  # a table that has dropped or renamed the row since
            return None, f"no GPU row: {exc}"
    names, why = _device_names(doc)
    if not names:
        return None, why or ""
    row = accelerator_for_device_name(names[0])
    if row is None:
        return None, f"no GPU row: its GPU, {names[0]}, is not in the accelerators table (fixtures/accelerators.toml)"
    return row, f"NVML: {names[0]}"


def _mean_tokens(counts: TokenCounts | None, n: int | None) -> int | None:
    """A workload's mean prompt or output tokens per request, rounded down (a shorter context is a faster step, so
    the bound stays a bound)."""
    return counts.total // n if counts is not None and n else None


def run_limit(doc: RunDocument, config: Mapping[str, Any] | None, *,
              gpu: Accelerator | None = None) -> tuple[RunLimit | None, str | None]:
    """The run's bound on paper (its GPU row, ``config``, lengths, TP and dtypes, ``gpu`` when given instead of the
    one NVML named), or None and why not, in a clause ("no GPU row: the engine ran on this host's CPU (no NVML:
    ...)")."""
    row, source = _gpu(doc, gpu)
    if row is None:
        return None, source
    engine, workload = doc.header.engine, doc.header.workload
    path = engine.model.path if engine.model is not None else None
    if config is None or path is None:
        return None, "the served model's config.json is not readable here"
    prompt, output = (_mean_tokens(c, workload.num_requests) for c in (workload.prompt_tokens, workload.output_tokens))
    if prompt is None or output is None:
        return None, "the workload's description has no token counts"
    argv = engine.server_args or []
    tp_text = _flag(argv, TP_FLAGS)
    tp = int(tp_text) if tp_text is not None and tp_text.isdigit() and int(tp_text) > 0 else 1
    weights = _dtype(_flag(argv, DTYPE_FLAGS)) or _dtype(config.get("torch_dtype")) or "bf16"
    kv = _dtype(_flag(argv, KV_DTYPE_FLAGS)) or weights
    name = path.rstrip("/").rsplit("/", 1)[-1] or path
    setup = Setup(row.name, source, name, tp, weights, kv, prompt, output)
    try:
        found = limits(config, row, prompt_len=prompt, output_len=output, model=name, tp=tp, weight_dtype=weights,
                       kv_dtype=kv, memory_fraction=1.0)
    except ValueError as exc:  # a PlanError: a config or an input the planner refuses
        return None, f"the bound cannot be worked out for {setup.text()}: {exc}"
    if found.plan.problem is not None or not found.plan.workload_fit:
        return None, f"not one sequence of the workload fits on paper for {setup.text()}"
    return RunLimit(setup, found), None
