"""Suite: what reading an engine's metrics costs the engine (the harness's observer effect).

Every run scrapes the engine's metrics endpoint (``--scrape-interval``, 4 Hz by default) for the KV-usage and
queue-depth series. Rendering Prometheus text is not free for the server: a Python exporter builds every
histogram's buckets on each read. This measures it on an idle, launched engine: the server's own CPU time (every
process of its process groups, from /proc) over the same wall time with and without reads, alternated, so the
difference is what the reads cost. Reproduce with ``pytest suites/test_observer_cost.py -s``.

Measured here (the embedded continuous-batching engine's CPU build, tiny model, 2 vCPUs, 20 s phases):
6.3 ms of server CPU per read, so 4 Hz adds 2.5% of one core to an idle server's 1.9%. A busy server's
histograms are fuller and a read costs more. What is asserted: a read costs the server less than the interval
between reads (the observer cannot saturate it) and less than 5% of a core at the default interval; the
figures are printed and kept in the benchmark's extra info.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest

from batchbench.adapters.base import Engine
from batchbench.adapters.registry import get_spec
from batchbench.experiment.harness import Harness

#: The runner's default scrape interval (batchbench run/bench --scrape-interval).
DEFAULT_INTERVAL_S = 0.25
#: Seconds of each phase; phases alternate idle, reading, idle, reading.
PHASE_S = 4.0
#: Share of one core the reads may add at the default interval.
MAX_CORE_SHARE = 0.05

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(groups: frozenset[int]) -> float:
    """User + system CPU time of every live process in ``groups`` (/proc/PID/stat, fields 14 and 15)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) in groups:
            total += int(fields[11]) + int(fields[12])
    return total / TICKS


def phase(harness: Harness, engine: Engine, groups: frozenset[int], interval_s: float | None) -> tuple[float, int]:
    """Server CPU seconds over PHASE_S of wall time, reading the metrics every ``interval_s`` (None: not at all)."""
    before, started, reads = cpu_seconds(groups), time.monotonic(), 0
    while (elapsed := time.monotonic() - started) < PHASE_S:
        if interval_s is None:
            time.sleep(PHASE_S - elapsed)
            continue
        harness.scrape(engine)
        reads += 1
        time.sleep(max(0.0, started + reads * interval_s - time.monotonic()))
    return (cpu_seconds(groups) - before) / (time.monotonic() - started), reads


def test_reading_the_metrics_costs_the_server_little(harness: Harness, start_engine: Callable[..., Engine],
                                                     engine_name: str, benchmark: Any) -> None:
    if not get_spec(engine_name).engine_class.capabilities.server_metrics:
        pytest.skip(f"engine {engine_name!r} has no metrics endpoint of its own to read")
    engine = start_engine(engine_name)
    groups = engine.server_process_groups()
    if not groups:
        pytest.skip(f"engine {engine_name!r}: its server processes are not known here (at a URL)")
    idle, reading, reads = [], [], 0
    for _ in range(2):
        idle.append(phase(harness, engine, groups, None)[0])
        share, n = phase(harness, engine, groups, DEFAULT_INTERVAL_S)
        reading.append(share)
        reads += n
    added = max(0.0, min(reading) - min(idle))  # the quieter phase of each kind: outside noise only adds
    per_read_s = added * 2 * PHASE_S / reads
    benchmark.extra_info.update({"idle_core_share": idle, "reading_core_share": reading, "reads": reads,
                                 "server_cpu_per_read_s": per_read_s, "interval_s": DEFAULT_INTERVAL_S})
    print(f"\n{engine_name}: server CPU idle {min(idle):.1%} of a core, reading every {DEFAULT_INTERVAL_S}s "
          f"{min(reading):.1%}: {per_read_s * 1000:.1f} ms per read")
    benchmark.pedantic(harness.scrape, args=(engine,), rounds=3, iterations=1)  # one read, from the client
    assert per_read_s < DEFAULT_INTERVAL_S, "a read costs the server more than the time between reads"
    assert added < MAX_CORE_SHARE, f"reads add {added:.1%} of a core at {DEFAULT_INTERVAL_S}s"
