"""What the GPUs did during a run, from NVML: power, the energy counter, utilisation, memory, clocks.

A serving benchmark on a GPU is also a question of watts: tokens per joule and cost per token decide a
deployment as much as tokens per second (the peers report them: AIPerf from DCGM, InferenceX tokens per MW).
NVML (nvidia-ml-py, import name ``pynvml``) is the driver's own library, present wherever the driver is, so it
is read directly rather than through DCGM (a daemon the hosts here do not run).

:class:`GpuMeter` reads the GPUs the engine uses (:class:`GpuSelection`: the ids its ``CUDA_VISIBLE_DEVICES`` or
container's ``--gpus`` name, every visible GPU when it names none) on a thread of its own at a fixed interval
through the run, beside the server-metrics scraper: an NVML call blocks for a fraction of a millisecond to a
few, and must not delay the measuring event loop's timestamps. Each sample is handed on as it is taken (the
runner journals it, so a killed run keeps what was sampled). The run's energy is the growth of each GPU's
total-energy counter (``nvmlDeviceGetTotalEnergyConsumption``, mJ since the driver loaded, Volta and later)
from :meth:`GpuMeter.start` to :meth:`GpuMeter.stop`; where the counter is not supported, the power samples
integrated over time (trapezoids), which the result says.

Utilisation is NVML's ``utilization.gpu`` (the share of the last sample period in which any kernel ran, not SM
occupancy: that needs DCGM's profiling metrics) and ``utilization.memory`` (the share in which device memory
was read or written).

Where there is no NVML (no driver, no GPU, pynvml not installed) every figure is None and
:attr:`GpuTelemetry.unavailable` says why (``no NVML: ...``), so a CPU host's document has the same keys.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import fmean
from types import ModuleType
from typing import Any, Literal

#: Where the run's joules came from: the GPUs' own energy counters, or the power samples integrated.
EnergySource = Literal["energy counter", "power samples"]


@dataclass(frozen=True)
class GpuDevice:
    """One GPU a run sampled, as NVML names it."""

    #: NVML's index (PCI bus order: CUDA's own order only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``).
    index: int
    name: str
    uuid: str
    memory_total_bytes: int | None = None
    power_limit_w: float | None = None


@dataclass(frozen=True)
class GpuSelection:
    """Which GPUs a run samples and why: those the engine uses, or every visible one (the header says which)."""

    devices: list[GpuDevice] = field(default_factory=list)
    #: How they were chosen, in a sentence ("CUDA_VISIBLE_DEVICES=0 of the engine's server", "every visible GPU:
    #: the engine names none").
    reason: str = ""
    #: Why nothing is sampled ("no NVML: NVML Shared Library Not Found"); None: the devices are sampled.
    unavailable: str | None = None
    #: The GPU the user named for the engine (``--gpu NAME``, a row of the accelerators table), where this host's
    #: NVML cannot see it (an engine at a URL): a later report draws the limit on paper for it unasked.
    declared: str | None = None


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment of a run (a None figure: this GPU or driver does not report it)."""

    #: Seconds since the run's start (the same clock as the records and the server metrics).
    t: float
    gpu: int
    power_w: float | None = None
    #: The total-energy counter, joules since the driver loaded.
    energy_j: float | None = None
    utilization_gpu: float | None = None
    utilization_memory: float | None = None
    memory_used_bytes: int | None = None
    sm_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None


@dataclass(frozen=True)
class GpuTelemetry:
    """What the sampled GPUs did over one run, all of them together (None: not measured, see ``unavailable``)."""

    #: Why there are no figures ("no NVML: ...", "no GPU sampled: ..."); None when there are.
    unavailable: str | None = None
    gpus: int = 0
    samples: int = 0
    interval_s: float | None = None
    #: Joules all sampled GPUs used over the run, and where the figure came from.
    energy_j: float | None = None
    energy_source: EnergySource | None = None
    #: Summed over the GPUs: mean and peak of the power samples' per-moment totals.
    mean_power_w: float | None = None
    peak_power_w: float | None = None
    #: Means over every GPU's samples, in percent.
    mean_utilization_gpu: float | None = None
    mean_utilization_memory: float | None = None
    #: The most memory one sampled GPU held at once.
    peak_memory_used_bytes: int | None = None
    mean_sm_clock_mhz: float | None = None
    #: Reads that failed (an NVML error on one GPU's figure), and the last such error.
    read_errors: int = 0
    last_error: str | None = None


@dataclass(frozen=True)
class Energy:
    """A run's energy and cost per unit of work: the summary's figures (None: not measured, see ``unavailable``)."""

    energy_j: float | None = None
    #: Output tokens per joule of the sampled GPUs.
    tokens_per_joule: float | None = None
    #: Joules per completed request.
    joules_per_request: float | None = None
    #: The price given (USD per GPU-hour, ``--gpu-hour-cost``), and what the run's output cost at it: the GPUs'
    #: hours over the run's duration, per million output tokens.
    gpu_hour_cost: float | None = None
    cost_per_million_output_tokens: float | None = None
    #: Why a figure is None, in a sentence.
    unavailable: str | None = None


@dataclass(frozen=True)
class GpuOptions:
    """How a run's GPUs are read: whether at all, at what interval, and the price of a GPU-hour for the cost."""

    enabled: bool = True
    #: Seconds between samples (None: the run's scrape interval, so GPU and server series line up).
    interval_s: float | None = None
    #: USD per GPU-hour (``--gpu-hour-cost``): the summary's cost per million output tokens.
    gpu_hour_cost: float | None = None
    #: The NVML module to read (None: ``pynvml``); tests give a fake one.
    nvml: ModuleType | None = None
    #: The GPU row the user named (``--gpu``), recorded in each run's ``gpus`` (:attr:`GpuSelection.declared`).
    declared: str | None = None

    def __post_init__(self) -> None:
        if self.gpu_hour_cost is not None and not self.gpu_hour_cost >= 0:
            raise ValueError(f"a GPU-hour's cost must be >= 0 USD, not {self.gpu_hour_cost}")

    def meter(self, devices: Sequence[str] | None, source: str, *, interval_s: float,
              on_sample: Callable[[GpuSample], None]) -> GpuMeter:
        """The meter for one run of an engine on ``devices`` (read from ``source``)."""
        return GpuMeter(devices, source, interval_s=self.interval_s or interval_s, on_sample=on_sample,
                        nvml=self.nvml, off=None if self.enabled else "GPU telemetry turned off (--no-gpu-telemetry)")


def energy_of(telemetry: GpuTelemetry, *, output_tokens: int, ok_requests: int, duration_s: float,
              gpu_hour_cost: float | None) -> Energy:
    """The summary's energy figures from a run's telemetry and what it served."""
    why = telemetry.unavailable
    joules = telemetry.energy_j
    if why is None and joules is None:
        why = "the GPUs reported neither an energy counter nor power"
    cost = None
    if gpu_hour_cost is not None:
        if telemetry.gpus and output_tokens:
            cost = gpu_hour_cost * telemetry.gpus * duration_s / 3600 / output_tokens * 1e6
        elif why is None:
            why = "no output tokens to charge the GPUs' time to"
    elif why is None:
        why = "no --gpu-hour-cost given: no cost figure"
    if joules is not None and not joules > 0:
        joules, why = None, f"the GPUs' energy counter did not grow ({telemetry.energy_j} J)"
    return Energy(
        energy_j=joules,
        tokens_per_joule=output_tokens / joules if joules else None,
        joules_per_request=joules / ok_requests if joules and ok_requests else None,
        gpu_hour_cost=gpu_hour_cost, cost_per_million_output_tokens=cost, unavailable=why)


def load_nvml(nvml: ModuleType | None = None) -> tuple[ModuleType | None, str | None]:
    """``nvml`` (None: the ``pynvml`` module) initialised, or None and why not (``no NVML: ...``)."""
    if nvml is None:
        try:
            import pynvml
        except ImportError as exc:
            return None, f"no NVML: pynvml is not installed (pip install nvidia-ml-py): {exc}"
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError and its generated subclasses; OSError from a broken library
        return None, f"no NVML: {exc or type(exc).__name__}"
    return nvml, None


def select_gpus(nvml: ModuleType, wanted: Sequence[str] | None, source: str) -> tuple[list[Any], GpuSelection]:
    """The handles of the GPUs to sample and the selection as the header records it.

    ``wanted``: the engine's device ids as CUDA reads them (indices, ``GPU-...`` UUIDs or their prefixes);
    None: every visible GPU. ``source`` says where they came from. Indices are taken as NVML's, which is CUDA's
    order only under ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (on a one-GPU host they agree). An id that names no GPU is
    said in :attr:`GpuSelection.unavailable` rather than guessed at.
    """
    count = nvml.nvmlDeviceGetCount()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
    if wanted is None:
        chosen = list(range(count))
        reason = f"every visible GPU: {source}"
    else:
        chosen, unknown = [], []
        for dev in wanted:
            match = [i for i, u in enumerate(uuids) if dev.startswith(("GPU-", "MIG-")) and u.startswith(dev)]
            if dev.isdigit() and int(dev) < count:
                match = [int(dev)]
            if match:
                chosen.append(match[0])
            else:
                unknown.append(dev)
        reason = f"{','.join(wanted) or 'none'}: {source}"
        if unknown:
            return [], GpuSelection([], reason, f"no GPU sampled: {', '.join(unknown)} names none of the "
                                                f"{count} GPU(s) NVML sees")
    devices = [GpuDevice(i, _text(nvml.nvmlDeviceGetName(handles[i])), uuids[i],
                         _read(lambda h: int(nvml.nvmlDeviceGetMemoryInfo(h).total), handles[i]),
                         _read(lambda h: nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000, handles[i]))
               for i in chosen]
    if not devices:
        return [], GpuSelection([], reason, "no GPU sampled: the engine uses none")
    return [handles[i] for i in chosen], GpuSelection(devices, reason)


class GpuMeter:
    """``start(t0)`` before a run, ``stop()`` after it: the GPUs' samples (handed to ``on_sample`` as taken) and
    the run's :class:`GpuTelemetry`.

    ``nvml``: the module to read (``pynvml`` when None; tests give a fake one). ``devices``: the engine's GPU ids
    (None: every visible GPU) and ``source`` where they were read.
    """

    def __init__(self, devices: Sequence[str] | None, source: str, *, interval_s: float,
                 on_sample: Callable[[GpuSample], None] = lambda sample: None,
                 nvml: ModuleType | None = None, off: str | None = None) -> None:
        """``off``: sample nothing, for this reason (telemetry turned off)."""
        if not interval_s > 0:
            raise ValueError(f"GPU sampling interval must be > 0, not {interval_s}")
        self.interval_s = interval_s
        self.on_sample = on_sample
        why = off
        if off is None:
            nvml, why = load_nvml(nvml)
        self._nvml = None if off is not None else nvml
        self._handles: list[Any] = []
        if self._nvml is None:
            self.selection = GpuSelection([], "not read", why)
        else:
            nvml = self._nvml
            try:
                self._handles, self.selection = select_gpus(nvml, devices, source)
            except Exception as exc:  # an NVML error listing the devices
                self.selection = GpuSelection([], source, f"no NVML: listing the GPUs failed: {exc}")
            if not self._handles:
                self._shutdown()
        self.samples: list[GpuSample] = []
        self.read_errors = 0
        self.last_error: str | None = None
        self._t0 = 0.0
        self._energy_start: list[float | None] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._result: GpuTelemetry | None = None

    def _shutdown(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):  # shutting down a library that is going away: nothing to keep
                self._nvml.nvmlShutdown()
            self._nvml = None

    def _value(self, read: Callable[[Any], Any], handle: Any) -> Any:
        try:
            return read(handle)
        except Exception as exc:  # NVMLError_NotSupported on older GPUs, a GPU fallen off the bus
            if "Not Supported" not in str(exc):
                self.read_errors += 1
                self.last_error = str(exc)
            return None

    def _energy(self, handle: Any) -> float | None:
        assert self._nvml is not None
        mj = self._value(self._nvml.nvmlDeviceGetTotalEnergyConsumption, handle)
        return None if mj is None else mj / 1000

    def _sample(self, gpu: int, handle: Any) -> GpuSample:
        nvml = self._nvml
        assert nvml is not None
        util = self._value(nvml.nvmlDeviceGetUtilizationRates, handle)
        memory = self._value(nvml.nvmlDeviceGetMemoryInfo, handle)
        power = self._value(nvml.nvmlDeviceGetPowerUsage, handle)
        return GpuSample(
            t=time.perf_counter() - self._t0, gpu=gpu,
            power_w=None if power is None else power / 1000, energy_j=self._energy(handle),
            utilization_gpu=None if util is None else float(util.gpu),
            utilization_memory=None if util is None else float(util.memory),
            memory_used_bytes=None if memory is None else int(memory.used),
            sm_clock_mhz=self._value(lambda h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM), handle),
            memory_clock_mhz=self._value(lambda h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM), handle))

    def _sample_all(self) -> None:
        for device, handle in zip(self.selection.devices, self._handles, strict=True):
            sample = self._sample(device.index, handle)
            self.samples.append(sample)
            try:
                self.on_sample(sample)
            except Exception as exc:  # the journal failed: the runner raises it; the sample is still kept here
                self.read_errors += 1
                self.last_error = f"handing on a sample failed: {exc}"

    def _loop(self) -> None:
        next_at = time.perf_counter()
        while not self._stop.is_set():
            self._sample_all()
            next_at += self.interval_s
            late = time.perf_counter() - next_at
            if late > 0:  # a read overran its slot: skip the missed ticks rather than read in a burst
                next_at += math.ceil(late / self.interval_s) * self.interval_s
            self._stop.wait(next_at - time.perf_counter())

    def start(self, t0: float) -> None:
        """Read the energy counters and start sampling; ``t0``: the run's start on ``time.perf_counter``."""
        self._t0 = t0
        if not self._handles:
            return
        self._energy_start = [self._energy(h) for h in self._handles]
        self._thread = threading.Thread(target=self._loop, name="batchbench-gpu", daemon=True)
        self._thread.start()

    def stop(self) -> GpuTelemetry:
        """Stop sampling (one last sample: the state at the end) and sum up the run. Safe to call twice."""
        if self._result is not None:
            return self._result
        if not self._handles or not self._energy_start:  # nothing sampled, or never started
            self._shutdown()
            self._result = GpuTelemetry(unavailable=self.selection.unavailable or "no GPU sampled: not started")
            return self._result
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self._sample_all()
        ends = [self._energy(h) for h in self._handles]
        self._shutdown()
        self._result = self._telemetry(ends)
        return self._result

    def _telemetry(self, ends: list[float | None]) -> GpuTelemetry:
        samples = self.samples
        counted = [(a, b) for a, b in zip(self._energy_start, ends, strict=True) if a is not None and b is not None]
        energy: float | None
        source: EnergySource | None
        if counted and len(counted) == len(ends):
            energy, source = sum(b - a for a, b in counted), "energy counter"
        else:
            energy = _integrated(samples, len(self._handles))
            source = "power samples" if energy is not None else None
        totals = [p for _, p in _power_moments(samples, len(self._handles))]
        return GpuTelemetry(
            gpus=len(self._handles), samples=len(samples), interval_s=self.interval_s,
            energy_j=energy, energy_source=source,
            mean_power_w=fmean(totals) if totals else None, peak_power_w=max(totals) if totals else None,
            mean_utilization_gpu=_mean(s.utilization_gpu for s in samples),
            mean_utilization_memory=_mean(s.utilization_memory for s in samples),
            peak_memory_used_bytes=max((s.memory_used_bytes for s in samples if s.memory_used_bytes is not None),
                                       default=None),
            mean_sm_clock_mhz=_mean(s.sm_clock_mhz for s in samples),
            read_errors=self.read_errors, last_error=self.last_error,
            unavailable=None if source is not None else "the GPUs reported neither an energy counter nor power")


def _text(value: Any) -> str:
    """pynvml returns str; older releases bytes."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _read(read: Callable[[Any], Any], handle: Any) -> Any:
    try:
        return read(handle)
    except Exception:  # a figure this GPU does not report: the device is still sampled
        return None


def _mean(values: Any) -> float | None:
    present = [float(v) for v in values if v is not None]
    return fmean(present) if present else None


def _power_moments(samples: Sequence[GpuSample], gpus: int) -> list[tuple[float, float]]:
    """(time, summed power) of every sampling moment at which each GPU reported power (samples come ``gpus`` at a
    time, in the same order)."""
    moments: list[tuple[float, float]] = []
    for start in range(0, len(samples) - gpus + 1, gpus):
        moment = [p for s in samples[start:start + gpus] if (p := s.power_w) is not None]
        if len(moment) == gpus:
            moments.append((samples[start].t, float(sum(moment))))
    return moments


def _integrated(samples: Sequence[GpuSample], gpus: int) -> float | None:
    """Joules from the power samples: trapezoids between moments (None: fewer than two moments with power)."""
    moments = _power_moments(samples, gpus)
    if len(moments) < 2:
        return None
    return sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in itertools.pairwise(moments))
