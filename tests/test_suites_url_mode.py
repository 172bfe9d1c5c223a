"""The comparison suites run unchanged against TGI and trtllm-serve in URL mode.

No GPU here: the engines are the local protocol servers that speak their wire
formats (fixtures/protocol_servers.py). This is the path a user takes with
``--engine tgi --engine-url tgi=http://host:port`` against a real deployment.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from batchbench.local_launch import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    procs, urls = [], {}
    try:
        for engine in ("tgi", "trtllm"):
            port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "fixtures.protocol_servers", engine, "--port", str(port),
                 "--token-delay", "0.005"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            urls[engine] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            for _ in range(100):
                try:
                    if httpx.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
        yield urls
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_suites_pass_against_protocol_servers(servers: dict[str, str], tmp_path: Path) -> None:
    args = [sys.executable, "-m", "pytest", "suites", "-q", "-p", "no:cacheprovider", "-rs",
            "--results-dir", str(tmp_path), "--benchmark-disable"]
    for engine, url in servers.items():
        args += ["--engine", engine, "--engine-url", f"{engine}={url}"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    tail = done.stdout[-3000:]
    assert done.returncode == 0, tail
    passed = int(re.search(r"(\d+) passed", tail).group(1))  # type: ignore[union-attr]
    assert passed >= 10, tail
    # Every engine produced results documents of its own.
    for engine in servers:
        assert list(tmp_path.glob(f"{engine}_*.json")), f"no results written for {engine}"
