"""The CPU quota over a process, read from cgroup v1 and v2 trees laid out as the kernel does, and how a run
whose load generator it throttled is told apart from one whose CPU other work held."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchbench.analysis.validity import load_reasons
from batchbench.core import codec
from batchbench.core.cpu_quota import CpuQuota, cpu_quota
from batchbench.measures.client_load import ClientLoad


def _tree(tmp_path: Path, cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "cgroup").write_text(cgroup)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return proc, root


def test_v1_the_tightest_quota_on_the_way_up_binds(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, "4:memory:/kubepods/pod1/c\n2:cpu,cpuacct:/kubepods/pod1/c\n0::/\n", {
        "cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000",
        "cpu/kubepods/cpu.cfs_quota_us": "400000", "cpu/kubepods/cpu.cfs_period_us": "100000",
        "cpu/kubepods/pod1/cpu.cfs_quota_us": "50000", "cpu/kubepods/pod1/cpu.cfs_period_us": "100000",
        "cpu/kubepods/pod1/cpu.stat": "nr_periods 10\nnr_throttled 4\nthrottled_time 2500000000\n",
        "cpu/kubepods/pod1/c/cpu.cfs_quota_us": "-1", "cpu/kubepods/pod1/c/cpu.cfs_period_us": "100000",
    })
    quota = cpu_quota(42, proc=proc, root=root)
    assert quota is not None and (quota.cpus, quota.version, quota.name) == (0.5, 1, "/kubepods/pod1")
    assert quota.text() == "a CPU quota of 0.5 CPUs (cgroup v1 /kubepods/pod1)"
    assert quota.throttled_s() == 2.5


def test_v2_reads_cpu_max_and_throttled_usec(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, "0::/pod/c\n", {
        "cgroup.controllers": "cpu memory", "pod/cpu.max": "150000 100000",
        "pod/cpu.stat": "usage_usec 9\nnr_throttled 3\nthrottled_usec 750000\n", "pod/c/cpu.max": "max 100000",
    })
    quota = cpu_quota(42, proc=proc, root=root)
    assert quota is not None and (quota.cpus, quota.version, quota.name) == (1.5, 2, "/pod")
    assert quota.throttled_s() == 0.75


@pytest.mark.parametrize(("cgroup", "files"), [
    ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}),  # no quota anywhere
    ("0::/\n", {"cpu.max": "max 100000"}),
    ("1:cpu:/x\n", {}),  # a hierarchy this process cannot read
    ("garbage\n\n", {"cpu.max": "50000 100000"}),  # lines that name no hierarchy
])
def test_no_quota_is_none(tmp_path: Path, cgroup: str, files: dict[str, str]) -> None:
    proc, root = _tree(tmp_path, cgroup, files)
    assert cpu_quota(42, proc=proc, root=root) is None
    assert cpu_quota(7, proc=proc, root=root) is None  # no such process


def _contended(**quota: object) -> ClientLoad:
    """A loop that woke 20 ms late (p90) while it waited for a CPU, not for its own work."""
    return ClientLoad(cpu_s=0.5, wall_s=2.0, busy_fraction=0.25, loop_lag_samples=40, loop_lag_p50_s=0.015,
                      loop_lag_p90_s=0.02, loop_lag_p99_s=0.025, loop_lag_max_s=0.03, loop_wait_s=0.6,
                      own_lag_p50_s=0.0, own_lag_p90_s=0.0, own_lag_p99_s=0.0, **quota)  # type: ignore[arg-type]


def test_a_run_its_quota_throttled_names_the_quota_as_the_cause() -> None:
    quota = CpuQuota(0.5, 1, "/kubepods/pod1", Path("/sys/fs/cgroup/cpu/kubepods/pod1")).text()
    (reason,) = load_reasons(_contended(cpu_quota=quota, quota_throttled_s=0.62), None)
    assert reason.kind == "machine contention"
    assert ("but its CPU quota: a CPU quota of 0.5 CPUs (cgroup v1 /kubepods/pod1) throttled it 31% of the run"
            in reason.text)
    assert codec.decode(ClientLoad, codec.encode(_contended(cpu_quota=quota, quota_throttled_s=0.62))).throttled


@pytest.mark.parametrize("throttled_s", [None, 0.0, 0.03])  # not measured, never, 1.5% of the run
def test_without_throttling_the_cause_is_other_work(throttled_s: float | None) -> None:
    (reason,) = load_reasons(_contended(cpu_quota="a CPU quota of 2 CPUs (cgroup v2 /ci)",
                                        quota_throttled_s=throttled_s), None)
    assert "but other work holding the CPU" in reason.text and "quota" not in reason.text
