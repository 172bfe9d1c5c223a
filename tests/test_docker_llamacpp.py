"""llama.cpp's server for real in a container: ``batchbench bench --launch docker --engine llamacpp`` on a CPU host.

The image is ``images.toml``'s ``cpu_image`` for llamacpp, built by ``docker/images.sh llamacpp`` from the server
this machine built (seconds where that is cached). The GGUF is made here and its folder mounted read-only; the
server is given the file's path in the container. A finished run leaves no container behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchbench.adapters.launch import llamacpp_build
from batchbench.adapters.launch.docker import MODEL_MOUNT
from batchbench.adapters.launch.images import load_specs
from tests.docker_engine import containers_of, cpu_build_client, new_run_id, remove_containers_of

pytestmark = [pytest.mark.docker_engine, pytest.mark.engine]

IMAGE = load_specs()["llamacpp"].cpu_image


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    yield from cpu_build_client("llamacpp", "llama.cpp's CUDA image")


def test_bench_runs_llamacpp_in_a_container_on_the_mounted_gguf(client: Any, tmp_path: Path) -> None:
    run_id = new_run_id()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "batchbench", "bench", "--launch", "docker", "--engine", "llamacpp",
             "--concurrency", "1,4", "--num-requests", "12", "--results-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=300,
            env=os.environ | {"BATCHBENCH_RUN_ID": run_id, "PYTHONUNBUFFERED": "1"})
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        assert containers_of(client, run_id) == []
    finally:
        remove_containers_of(client, run_id)
    (run_dir,) = tmp_path.glob("bench-*")
    docs = [json.loads(p.read_text()) for p in sorted(run_dir.glob("llamacpp_*.json"))]
    assert [d["labels"]["concurrency"] for d in docs] == [1, 4]
    for doc in docs:
        assert doc["summary"]["ok"] == 12 and doc["summary"]["failed"] == 0
        engine = doc["engine"]
        assert engine["launch"]["image"] == IMAGE and engine["launch"]["gpus"] == []
        args = engine["server_args"]
        gguf = args[args.index("-m") + 1]
        assert gguf.startswith(MODEL_MOUNT + "/") and gguf.endswith(".gguf")
        assert engine["launch"]["model_mount"]["mode"] == "ro"
        # The server in the image is the build made here: its /props names the same commit.
        assert str(engine["version"]).endswith(llamacpp_build.LLAMA_CPP_COMMIT)
        # The server's own count of every request's output tokens is what was asked for.
        assert all(r["completion_tokens"] == r["max_tokens"] > 0 for r in doc["records"])
