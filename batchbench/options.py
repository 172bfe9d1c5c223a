"""The engine options, declared once for the ``batchbench`` CLI and the pytest plugin.

Both front ends register :class:`EngineArgs` and :class:`TelemetryArgs` (:func:`batchbench.core.options.add_options`
takes argparse's parser or a pytest option group) and turn them into the same
:class:`~batchbench.adapters.registry.EngineOptions` through :func:`engine_options`, which checks every engine and
combination before anything starts: a bad option is a usage error in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchbench.adapters.auth import API_KEY_ENV, auth_from
from batchbench.adapters.base import EngineError
from batchbench.adapters.launch.images import image_problem
from batchbench.adapters.registry import (
    LAUNCH_MODES,
    EngineOptions,
    LaunchMode,
    embedded_engines,
    engine_names,
    launch_mode,
    make_engine,
    parse_engine_urls,
)
from batchbench.analysis.accelerators import Accelerator, UnknownAccelerator, find_accelerator
from batchbench.core.config import DEFAULT_ENDPOINT, ENDPOINTS, BatchingConfig, Endpoint
from batchbench.core.options import OptionGroup, option
from batchbench.core.placement import (
    NO_AFFINITY,
    ONE_CPU,
    CpuPlacement,
    can_pin,
    default_placement,
    parse_placement,
    usable_cpus,
)
from batchbench.measures.gpu import GpuOptions
from batchbench.workload.profiles import PROFILES, Profile


@dataclass(frozen=True)
class EngineArgs(OptionGroup):
    """The engine options, each declared once: which engines, where, with what. :meth:`resolve` checks them all."""

    engine: list[str] = option(
        "--engine", default_factory=list, action="append", choices=engine_names,
        help=lambda: f"engine to compare (repeatable; default: {' '.join(embedded_engines())})")
    engine_url: list[str] = option(
        "--engine-url", default_factory=list, action="append", metavar="NAME=URL",
        help="reach an engine someone else runs at a URL instead of starting it (repeatable)")
    api_key: str | None = option(
        "--api-key", metavar="KEY",
        help=f"sent as 'Authorization: Bearer KEY' with every request (default: ${API_KEY_ENV}); a vLLM batchbench "
             "starts requires it. Never written to results, logs or reports")
    header: list[str] = option(
        "--header", default_factory=list, action="append", metavar="NAME=VALUE",
        help="an HTTP header sent with every request (repeatable), e.g. a gateway's tenant or key header; its value "
             "is never written anywhere")
    model: str | None = option(
        "--model",
        help="model path or Hugging Face id, or a shipped model: tiny-llama, llama-3-8b-shaped (seeded random "
             "weights, nothing downloaded; default: the 8B-shaped one on a GPU host, else the tiny one)")
    launch: LaunchMode = option(
        "--launch", default=EngineOptions.launch, choices=LAUNCH_MODES,
        help="how to start engines without a URL (auto, the default: a container on a GPU host, else a local "
             "process)")
    profile: str = option("--profile", default="quick", choices=sorted(PROFILES),
                          help="sizes: quick (CPU, the default) or full (GPU)")
    results_dir: Path = option("--results-dir", default=Path("results"), type=Path,
                               help="where results documents are written (default %(default)s)")
    batching: list[str] = option(
        "--batching", default_factory=list, action="append", metavar="KEY=VALUE,...",
        help="batching config (repeatable: a grid), e.g. max_batch_size=16,chunked_prefill=false; keys: "
             f"{', '.join(BatchingConfig.__dataclass_fields__)}; 'default' is each engine's default")
    cpus: str | None = option(
        "--cpus", metavar="engine=LIST,client=LIST|none",
        help="which CPUs launched engines and the load generator run on, kept apart so neither stalls the other "
             "(default: one CPU per load-generator process, the lowest, the engine the rest; none: unplaced, as "
             "the OS schedules them); each results document records it")
    endpoint: Endpoint = option(
        "--endpoint", default=DEFAULT_ENDPOINT, choices=ENDPOINTS,
        help="completions (the default: token-id prompts, identical for every engine) or chat "
             "(/v1/chat/completions: messages of text of the same token lengths under the served model's "
             "tokenizer, through its chat template; reasoning tokens timed and counted apart)")
    image: list[str] = option(
        "--image", default_factory=list, action="append", metavar="ENGINE=REF",
        help="run ENGINE's container from this image instead of the one adapters/images.toml pins (repeatable; an "
             "explicit tag, not latest), e.g. vllm=batchbench-vllm-cpu:0.32.0, built here by docker/images.sh "
             "vllm-cpu; the rest of the engine's container spec is kept")

    @property
    def sizes(self) -> Profile:
        """The ``--profile``'s sizes."""
        return PROFILES[self.profile]

    def resolve(self) -> tuple[tuple[str, ...], EngineOptions]:
        """The selected engines and their options (:func:`engine_options`); ValueError for the user."""
        return engine_options(self.engine, engine_urls=self.engine_url, model=self.model, launch=self.launch,
                              profile=self.sizes, results_dir=self.results_dir, cpus=self.cpus, api_key=self.api_key,
                              headers=self.header, endpoint=self.endpoint, images=self.image)


def gpu_hour_cost(text: str) -> float:
    """``--gpu-hour-cost``: USD per GPU-hour, a finite number >= 0 (argparse reports anything else at once)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected USD per GPU-hour such as 3.5, not {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"a GPU-hour's price is a finite number >= 0, not {text}")
    return value


@dataclass(frozen=True)
class TelemetryArgs(OptionGroup):
    """How the GPUs the engines use are read: ``--gpu-hour-cost`` and ``--no-gpu-telemetry``."""

    gpu_hour_cost: float | None = option(
        "--gpu-hour-cost", type=gpu_hour_cost, metavar="USD",
        help="price of one GPU-hour in USD: each run's summary gives the cost per million output tokens (the GPUs "
             "sampled x the run's duration)")
    no_gpu_telemetry: bool = option(
        "--no-gpu-telemetry", default=False, action="store_true",
        help="do not read the GPUs through NVML during runs (by default each run samples power, energy, "
             "utilisation, memory and clocks of the engine's GPUs; without NVML the document says why not)")

    def gpu(self, declared: Accelerator | None = None) -> GpuOptions:
        """The telemetry options, with the GPU the user named (``--gpu``) to record in each run."""
        return GpuOptions(enabled=not self.no_gpu_telemetry, gpu_hour_cost=self.gpu_hour_cost,
                          declared=declared.name if declared is not None else None)


def accelerator(text: str) -> Accelerator:
    """A GPU of the accelerators table, named loosely (``H100`` is the H100 SXM); the known ones otherwise."""
    try:
        return find_accelerator(text)
    except UnknownAccelerator as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def gpu_option() -> Any:
    """``--gpu NAME``: the GPU the runs' limit on paper is worked out for, where NVML cannot name it (a field of each
    command that measures or reports)."""
    return option(
        "--gpu", type=accelerator, metavar="NAME",
        help="the GPU the engine serves on (H100, H100-PCIe, H200, B200, A100, L40S, MI300X): the report sets each "
             "point beside the limit on paper for it (default: the GPU NVML names in each run; an engine at a URL "
             "may be on a GPU this host cannot see)")


def parse_images(values: Sequence[str], selected: Sequence[str], options: EngineOptions) -> tuple[tuple[str, str], ...]:
    """``--image ENGINE=REF`` values -> (engine, image) pairs; ValueError for one that names no selected engine,
    an image without a pinned tag, or an engine that starts no container (at a URL, or a local process)."""
    images: dict[str, str] = {}
    for value in values:
        name, sep, image = value.partition("=")
        if not sep or not name or not image:
            raise ValueError(f"--image {value!r}: write ENGINE=IMAGE:TAG, e.g. vllm=batchbench-vllm-cpu:0.32.0")
        if name not in selected:
            raise ValueError(f"--image {value}: engine {name!r} is not selected (add --engine {name})")
        if (problem := image_problem(image)) is not None:
            raise ValueError(f"--image {value}: {problem}")
        if options.url_for(name) is not None:
            raise ValueError(f"--image {value}: engine {name!r} is reached at a URL, so no container is started")
        if launch_mode(name, options) != "docker":
            raise ValueError(f"--image {value}: engine {name!r} runs as a local process here (--launch "
                             f"{options.launch}); add --launch docker to run it in a container")
        if name in images and images[name] != image:
            raise ValueError(f"--image {value}: engine {name!r} already runs {images[name]}")
        images[name] = image
    return tuple(images.items())


def engine_options(
    engines: Sequence[str], *, engine_urls: Sequence[str], model: str | None, launch: LaunchMode, profile: Profile,
    results_dir: Path, cpus: str | None = None, api_key: str | None = None, headers: Sequence[str] = (),
    endpoint: Endpoint = DEFAULT_ENDPOINT, images: Sequence[str] = (),
) -> tuple[tuple[str, ...], EngineOptions]:
    """The selected engines (default: the embedded ones) and their options, every engine checked.

    Raises ValueError with a message for the user: an unknown engine, a URL or an ``--image`` for an engine that
    is not selected, an engine that cannot run as asked (hf-static in a container, chat on an engine without a chat
    route), an ``--image`` for an engine that starts no container (:func:`parse_images`), a ``--cpus`` that cannot
    be applied (:func:`choose_placement`), a malformed ``--header``. ``api_key`` None: ``$OPENAI_API_KEY``, if set.
    """
    if model is not None and model.startswith(("/", "./", "../", "~")) and not Path(model).expanduser().exists():
        # A hub id is NAME or ORG/NAME; something written as a path must be there now, not fail at engine start.
        raise ValueError(f"--model {model}: no such file or folder (a model on the hub is given as ORG/NAME)")
    selected = tuple(engines) or embedded_engines()
    urls = parse_engine_urls(list(engine_urls), list(selected))
    for name, url in urls:
        if name not in selected:
            raise ValueError(f"--engine-url {name}={url}: engine {name!r} is not selected (add --engine {name})")
    placement, unplaced = choose_placement(cpus)
    options = EngineOptions(model=model, urls=urls, launch=launch,
                            max_model_len=profile.max_model_len, log_dir=results_dir / "server-logs",
                            placement=placement, unplaced=unplaced, auth=auth_from(api_key, headers),
                            endpoint=endpoint)
    options = dataclasses.replace(options, images=parse_images(images, selected, options))
    for name in selected:
        try:
            make_engine(name, None, options)
        except EngineError as exc:  # a malformed --engine-url: a usage error, found before anything starts
            raise ValueError(str(exc)) from None
    return selected, options


def choose_placement(cpus: str | None, load_processes: int = 1) -> tuple[CpuPlacement | None, str | None]:
    """``--cpus`` (None: not given) -> the placement, or None and why there is none.

    Not given: :func:`default_placement` for ``load_processes`` processes sending load. A malformed or impossible
    ``--cpus`` is a usage error (ValueError).
    """
    if cpus is not None:
        placement = parse_placement(cpus, usable_cpus())
        if placement is None:
            return None, f"turned off (--cpus {cpus})"
        if not can_pin():
            raise ValueError(f"--cpus {cpus!r}: {NO_AFFINITY}")
        return placement, None
    if not can_pin():
        return None, NO_AFFINITY
    placement = default_placement(usable_cpus(), load_processes)
    return (placement, None) if placement is not None else (None, ONE_CPU)


def with_load_processes(options: EngineOptions, cpus: str | None, load_processes: int) -> EngineOptions:
    """The options with the default placement made for ``load_processes`` processes sending load (a CPU each,
    where there are CPUs to spare); a ``--cpus`` placement, or none, is kept as it is."""
    if cpus is not None or options.placement is None or load_processes <= 1:
        return options
    placement, unplaced = choose_placement(None, load_processes)
    return dataclasses.replace(options, placement=placement, unplaced=unplaced)


def batching_grid(specs: Sequence[str]) -> list[BatchingConfig | None]:
    """``--batching`` values → configs (``None``: the engine's default); one default when none is given."""
    return [BatchingConfig.parse(spec) for spec in (specs or ["default"])]
