"""A test server in a process of its own, on a free port, yielded once its /health answers.

Used for the protocol servers (``python -m batchbench.fixtures.protocol ENGINE``) where the client under
test must not share their CPU or event loop.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from batchbench.adapters.launch.local import free_port

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def serving(module: str, *args: str, ready_path: str = "/health",
            headers: dict[str, str] | None = None) -> Iterator[str]:
    """``python -m module *args --port P`` from the repository root; yields its base URL once ``ready_path``
    answers 200 (asked with ``headers``), kills it after."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", module, *args, "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                if httpx.get(url + ready_path, headers=headers).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url
    finally:
        proc.kill()
        proc.wait()
