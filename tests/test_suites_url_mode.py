"""The comparison suites run unchanged against TGI, trtllm-serve and SGLang in URL mode.

No GPU here: the engines are the local protocol servers that speak their wire
formats (fixtures/protocol/). This is the path a user takes with
``--engine tgi --engine-url tgi=http://host:port`` against a real deployment.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.server_process import serving

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    with ExitStack() as stack:
        yield {engine: stack.enter_context(
                   serving("batchbench.fixtures.protocol", engine, "--token-delay", "0.005"))
               for engine in ("tgi", "trtllm", "sglang")}


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
        assert list(tmp_path.glob(f"pytest-*/{engine}_*.json")), f"no results written for {engine}"
