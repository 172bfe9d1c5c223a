"""The CPU quota a process runs under (a Kubernetes pod's CPU limit, ``docker run --cpus``, a CI runner's
cgroup), and how long it has been throttled by it.

Why: a process under a CFS quota waits for CPU time the machine has idle. Its run-queue delay rises as if other
work held its CPU, so without this the client-load check blames "other work holding the CPU" and the user looks
for a noisy neighbour that does not exist. With it, the run says which quota held it back and for how long, and
the remedy (a larger limit) follows.

Read from the cgroup files (cgroup v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us`` and ``cpu.stat``'s
``throttled_time``; v2 ``cpu.max`` and ``throttled_usec``), from the process's own group up to the root: the
tightest quota on the way binds. Written by hand: no library reads cgroup CPU quotas (psutil does not).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuQuota:
    """The tightest CPU quota over a process: CPUs' worth of time per period, and the group that sets it."""

    cpus: float
    version: int
    #: The group as the process's ``/proc/PID/cgroup`` names it (``/kubepods/pod1``; ``/``: the root).
    name: str
    #: Its folder (cgroup v1: under the cpu controller's mount; v2: under the unified root).
    group: Path

    def text(self) -> str:
        """``a CPU quota of 0.5 CPUs (cgroup v1 /kubepods/pod1)``."""
        return f"a CPU quota of {self.cpus:.3g} CPUs (cgroup v{self.version} {self.name})"

    def throttled_s(self) -> float | None:
        """Seconds the group has been throttled in all (its ``cpu.stat``), None where not readable."""
        try:
            stat = dict(line.split() for line in (self.group / "cpu.stat").read_text().splitlines() if " " in line)
            if self.version == 1:
                return int(stat["throttled_time"]) / 1e9
            return int(stat["throttled_usec"]) / 1e6
        except (OSError, KeyError, ValueError):
            return None


def _group_path(pid: int | str, proc: Path) -> tuple[int, str] | None:
    """The process's cgroup: (1, path) under the v1 cpu controller, else (2, path) in the unified hierarchy."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    unified = None
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:  # not a hierarchy line (none such today; never worth a crash of the run)
            continue
        _, controllers, path = fields
        if "cpu" in controllers.split(","):
            return 1, path
        if controllers == "":
            unified = path
    return (2, unified) if unified is not None else None


def _quota_v1(group: Path) -> float | None:
    try:
        quota = int((group / "cpu.cfs_quota_us").read_text())
        period = int((group / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _quota_v2(group: Path) -> float | None:
    try:
        quota, period = (group / "cpu.max").read_text().split()
        return int(quota) / int(period) if quota != "max" and int(period) > 0 else None
    except (OSError, ValueError):
        return None


def cpu_quota(pid: int | str = "self", *, proc: Path = PROC, root: Path = CGROUP_ROOT) -> CpuQuota | None:
    """The tightest CPU quota over process ``pid`` (``self``: this one), None where it has none (or no cgroup
    says so: another OS, an unreadable hierarchy)."""
    found = _group_path(pid, proc)
    if found is None:
        return None
    version, path = found
    if version == 1:
        mounts = [m for m in (root / "cpu", root / "cpu,cpuacct") if (m / "cpu.cfs_quota_us").exists()]
        if not mounts:
            return None
        base, read = mounts[0], _quota_v1
    else:
        base, read = root, _quota_v2
    parts = [p for p in path.split("/") if p]
    tightest: CpuQuota | None = None
    for depth in range(len(parts), -1, -1):
        group = base.joinpath(*parts[:depth])
        cpus = read(group)
        if cpus is not None and (tightest is None or cpus < tightest.cpus):
            tightest = CpuQuota(cpus, version, "/" + "/".join(parts[:depth]), group)
    return tightest
