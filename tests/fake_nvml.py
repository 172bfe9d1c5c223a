"""A stand-in for ``pynvml`` (nvidia-ml-py 13's names and units) over GPUs whose readings the test sets.

It is a module object, as ``pynvml`` is, handed to :class:`batchbench.measures.gpu.GpuMeter`: the meter's own code
runs unchanged against it. Units are NVML's: power in mW, the energy counter in mJ, memory in bytes, clocks in
MHz, utilisation in percent. The energy counter grows with the time since ``nvmlInit`` at each GPU's power, so a
run's joules are the power times its length, as on a real GPU.
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass
from typing import Any


class NVMLError(Exception):
    """pynvml's base error (its subclasses carry messages such as "Not Supported")."""


@dataclass
class FakeGpu:
    name: str = "NVIDIA H200"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    power_w: float = 500.0
    util_gpu: int = 90
    util_memory: int = 60
    memory_used: int = 80 * 2**30
    memory_total: int = 141 * 10**9
    sm_clock: int = 1980
    memory_clock: int = 3201
    #: False: nvmlDeviceGetTotalEnergyConsumption raises "Not Supported" (pre-Volta GPUs).
    energy_counter: bool = True


def fake_nvml(gpus: list[FakeGpu], *, init_error: str | None = None) -> types.ModuleType:
    """A ``pynvml``-shaped module over ``gpus``; ``init_error``: nvmlInit raises it (no driver)."""
    nvml = types.ModuleType("pynvml")
    state: dict[str, Any] = {"started": None, "inits": 0, "shutdowns": 0}
    nvml.NVMLError = NVMLError  # type: ignore[attr-defined]
    nvml.NVML_CLOCK_SM = 1  # type: ignore[attr-defined]
    nvml.NVML_CLOCK_MEM = 2  # type: ignore[attr-defined]
    nvml.state = state  # type: ignore[attr-defined]

    def init() -> None:
        if init_error is not None:
            raise NVMLError(init_error)
        state["inits"] += 1
        state["started"] = time.perf_counter()

    def shutdown() -> None:
        state["shutdowns"] += 1

    def gpu(handle: int) -> FakeGpu:
        if state["started"] is None:
            raise NVMLError("Uninitialized")
        return gpus[handle]

    def energy(handle: int) -> int:
        g = gpu(handle)
        if not g.energy_counter:
            raise NVMLError("Not Supported")
        return int(g.power_w * (time.perf_counter() - state["started"]) * 1000) + 10**9  # mJ since "driver load"

    def clock(handle: int, kind: int) -> int:
        return gpu(handle).sm_clock if kind == 1 else gpu(handle).memory_clock

    functions = {
        "nvmlInit": init, "nvmlShutdown": shutdown,
        "nvmlDeviceGetCount": lambda: len(gpus),
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: gpu(h).name,
        "nvmlDeviceGetUUID": lambda h: gpu(h).uuid,
        "nvmlDeviceGetPowerUsage": lambda h: int(gpu(h).power_w * 1000),
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: 700_000,
        "nvmlDeviceGetTotalEnergyConsumption": energy,
        "nvmlDeviceGetUtilizationRates": lambda h: types.SimpleNamespace(gpu=gpu(h).util_gpu,
                                                                         memory=gpu(h).util_memory),
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(used=gpu(h).memory_used,
                                                                   total=gpu(h).memory_total,
                                                                   free=gpu(h).memory_total - gpu(h).memory_used),
        "nvmlDeviceGetClockInfo": clock,
    }
    for name, fn in functions.items():
        setattr(nvml, name, fn)
    return nvml
