"""What the tests against a real Docker Engine share: the client, the images they run, the containers a test left.

They skip, with the reason, only where no Docker Engine answers or the images cannot be built here;
``BATCHBENCH_REQUIRE_DOCKER=1`` (``.ci/run`` sets it, having started a daemon) makes that a failure, so CI cannot
pass with the real daemon untested. The images come from ``docker/images.sh``, cached by tag: the first test
that needs one builds it, later ones find it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from batchbench.adapters.launch.docker import LABEL_RUN, docker_host

ROOT = Path(__file__).resolve().parent.parent
BASE_IMAGE = "batchbench-base:bookworm"
#: The vLLM protocol server with vLLM's command line as its entrypoint: a stand-in for a vLLM image.
PROTOCOL_IMAGE = "batchbench-protocol:local"
VLLM_CPU_IMAGE = "batchbench-vllm-cpu:0.32.0"
REQUIRED = os.environ.get("BATCHBENCH_REQUIRE_DOCKER") == "1"


def unavailable(reason: str) -> NoReturn:
    """Skip with ``reason``, or fail where a Docker Engine is required."""
    if REQUIRED:
        pytest.fail(f"BATCHBENCH_REQUIRE_DOCKER=1, but {reason}", pytrace=False)
    pytest.skip(reason)


def engine_client() -> Any:
    """A docker SDK client whose daemon answered a ping."""
    try:
        import docker
    except ImportError:
        unavailable("the docker SDK is not installed (pip install -e '.[docker]')")
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except Exception as exc:
        unavailable(f"no Docker Engine answers at {docker_host()}: {exc}")
    return client


def build_images(*names: str, timeout_s: float = 1800) -> None:
    """``docker/images.sh NAMES``: seconds when they are built already, minutes the first time."""
    try:
        proc = subprocess.run([str(ROOT / "docker" / "images.sh"), *names], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s, env=os.environ | {"PYTHON": sys.executable})
    except subprocess.TimeoutExpired:
        unavailable(f"docker/images.sh {' '.join(names)} did not finish within {timeout_s:.0f}s")
    if proc.returncode != 0:
        unavailable(f"docker/images.sh {' '.join(names)} failed: {(proc.stdout + proc.stderr)[-1500:]}")


def new_run_id() -> str:
    """A run id of the test's own (``batchbench.run`` label), so it finds and removes only its containers."""
    return f"test-{uuid.uuid4().hex[:10]}"


def containers_of(client: Any, run_id: str) -> list[Any]:
    """Every container, running or not, labelled with ``run_id``."""
    return client.containers.list(all=True, filters={"label": f"{LABEL_RUN}={run_id}"})


def remove_containers_of(client: Any, run_id: str) -> None:
    """What a failed test left (a passing one leaves nothing, and says so in its own assertions)."""
    for container in containers_of(client, run_id):
        container.remove(force=True)



def cpu_build_client(image: str, gpu_image: str) -> Iterator[Any]:
    """A client for the tests of one engine's CPU image (``docker/images.sh IMAGE``, built where missing); on a GPU
    host they skip, since ``--launch docker`` runs ``gpu_image`` there. A module fixture's body: ``yield from``."""
    from batchbench.adapters.registry import default_model
    from batchbench.fixtures import TINY_MODEL

    c = engine_client()
    if default_model() != TINY_MODEL:
        pytest.skip(f"a GPU host: --launch docker runs {gpu_image} there, not the CPU build")
    build_images(image)
    yield c
    c.close()
