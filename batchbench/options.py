"""The engine options, defined once for the ``batchbench`` CLI and the pytest plugin.

Both front ends add the same arguments (:func:`add_engine_arguments` takes argparse's
``add_argument`` or pytest's ``addoption``, which accept the same keywords) and turn them into the
same :class:`~batchbench.adapters.registry.EngineOptions` through :func:`engine_options`, which checks
every engine and combination before anything starts: a bad option is a usage error in seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from batchbench.adapters.base import BatchingConfig
from batchbench.adapters.registry import (
    EngineOptions,
    embedded_engines,
    engine_names,
    make_engine,
    parse_engine_urls,
)
from batchbench.profiles import PROFILES, Profile


def add_engine_arguments(add: Callable[..., Any]) -> None:
    """``--engine``, ``--engine-url``, ``--model``, ``--launch``, ``--profile``, ``--results-dir``, ``--batching``."""
    add("--engine", action="append", default=[], choices=engine_names(),
        help=f"engine to compare (repeatable; default: {' '.join(embedded_engines())})")
    add("--engine-url", action="append", default=[], metavar="NAME=URL",
        help="reach an engine someone else runs at a URL instead of starting it (repeatable)")
    add("--model", default=None,
        help="model path or Hugging Face id (default: the tiny dummy-weight Llama shipped in batchbench.fixtures)")
    add("--launch", default="auto", choices=["auto", "local", "docker"],
        help="how to start engines without a URL (auto: a container on a GPU host, else a local process)")
    add("--profile", default="quick", choices=sorted(PROFILES), help="sizes: quick (CPU) or full (GPU)")
    add("--results-dir", default=Path("results"), type=Path, help="where results documents are written")
    add("--batching", action="append", default=[], metavar="KEY=VALUE,...",
        help="batching config (repeatable: a grid), e.g. max_batch_size=16,chunked_prefill=false; keys: "
             f"{', '.join(BatchingConfig.__dataclass_fields__)}; 'default' is each engine's default")


def engine_options(
    engines: Sequence[str], *, engine_urls: Sequence[str], model: str | None, launch: str, profile: Profile,
    results_dir: Path,
) -> tuple[tuple[str, ...], EngineOptions]:
    """The selected engines (default: the embedded ones) and their options, every engine checked.

    Raises ValueError with a message for the user: an unknown engine, a URL for an engine that is not
    selected, an engine that cannot run as asked (hf-static at a URL, a container without --model).
    """
    if model is not None and model.startswith(("/", "./", "../", "~")) and not Path(model).expanduser().exists():
        # A hub id is NAME or ORG/NAME; something written as a path must be there now, not fail at engine start.
        raise ValueError(f"--model {model}: no such file or folder (a model on the hub is given as ORG/NAME)")
    selected = tuple(engines) or embedded_engines()
    urls = parse_engine_urls(list(engine_urls), list(selected))
    for name, url in urls:
        if name not in selected:
            raise ValueError(f"--engine-url {name}={url}: engine {name!r} is not selected (add --engine {name})")
    options = EngineOptions(model=model, urls=urls, launch=launch,  # type: ignore[arg-type]
                            max_model_len=profile.max_model_len, log_dir=results_dir / "server-logs")
    for name in selected:
        make_engine(name, None, options)
    return selected, options


def batching_grid(specs: Sequence[str]) -> list[BatchingConfig | None]:
    """``--batching`` values → configs (``None``: the engine's default); one default when none is given."""
    return [BatchingConfig.parse(spec) for spec in (specs or ["default"])]
