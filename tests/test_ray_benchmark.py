"""Benchmark: the same load from one local load generator and from two workers on a two-node Ray cluster.

The fast stream server (first token 20 ms after arrival, then one every 10 ms; its own account of what it did is
the truth) runs on one CPU; this process, the Ray cluster it starts (``ray.cluster_utils.Cluster``: a head and a
second node, one logical CPU each) and the workers Ray places share the other. Each round runs both layouts at
each load, alternating which goes first:

- open loop, Poisson 1,000 requests/s of 8 tokens for 4 s (the issue's per-request figure);
- closed loop, 128 streams of 32 tokens for 3 s (chunks/s).

For each run it prints chunks/s, the client's CPU per chunk (this process, plus the workers' and Ray's own
processes on Ray), the TTFT p50 and ITL p50 errors against the server's truth, the schedule lag p99, whether
:mod:`batchbench.analysis.validity` calls the run valid, and what Ray adds per record (its run's client CPU less
the local run's, over the records). ``pytest tests/test_ray_benchmark.py -s`` prints the table;
``BATCHBENCH_BENCH_ROUNDS=3`` runs more rounds (default 1); ``--benchmark-json=out.json`` keeps them.

On two CPUs this measures what Ray costs, not what it buys: the workers share one CPU with the driver and Ray's
daemons, where on a cluster each has a host of its own (docs/ray.md).
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from batchbench import selftest
from batchbench.adapters.vllm import VLLMEngine
from batchbench.analysis import validity
from batchbench.core import eventloop
from batchbench.core.config import LoadConfig, ModelRef
from batchbench.load import ray_workers
from batchbench.load.runner import MeasuredRun, run
from batchbench.workload.requests import Arrival, Lengths, Workload, WorkloadSpec

ROUNDS = int(os.environ.get("BATCHBENCH_BENCH_ROUNDS", "1"))
SETTINGS = selftest.Settings()
LOADS = {"poisson 1000/s": (Arrival("poisson", rate=1000.0), 8, 4.0),
         "closed c=128": (Arrival("closed", concurrency=128), 32, 3.0)}

pytestmark = pytest.mark.skipif(ray_workers.unusable(None) == ray_workers.RAY_MISSING, reason="Ray is not installed")


def _ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def _cpu_s(pids: set[int]) -> dict[int, float]:
    hz = os.sysconf("SC_CLK_TCK")
    return {pid: _ticks(pid) / hz for pid in pids}


@dataclass
class Row:
    load: str
    layout: str
    round: int
    chunks: int
    chunks_per_s: float
    records: int
    driver_cpu_s: float
    worker_cpu_s: float
    ray_cpu_s: float
    ttft_error_ms: float | None
    itl_error_ms: float | None
    lag_p99_ms: float | None
    verdict: str

    @property
    def client_cpu_s(self) -> float:
        return self.driver_cpu_s + self.worker_cpu_s + self.ray_cpu_s


@pytest.fixture(scope="module")
def placed() -> Iterator[tuple[str, Any, set[int], str]]:
    """The fast server on one CPU; this process and the Ray cluster it starts on the other."""
    where = selftest.placement()
    from ray.cluster_utils import Cluster

    with selftest.fast_server(SETTINGS, cpu=where.server) as url, selftest.pinned(where.client):
        server = {pid for pid in ray_workers._descendants(os.getpid())
                  if b"protocol.fast" in Path(f"/proc/{pid}/cmdline").read_bytes()}
        # Two logical CPUs a node: the scale benchmark places four workers; two spread one on each.
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        try:
            yield url, cluster, server, where.describe()
        finally:
            ray_workers.disconnect()
            cluster.shutdown()


def _row(load: str, layout: str, k: int, result: MeasuredRun, truth: dict[str, Any], driver_s: float, ray_s: float,
         arrival: Arrival) -> Row:
    s = result.summary
    assert s.requests > 0 and s.failed == 0, f"{load} {layout}: {s.failed} of {s.requests} requests failed"
    judged = validity.check(s, status=result.status, arrival=arrival.kind, client=result.client,
                            machine=result.machine, warmed_up=True)
    ttft = truth.get("ttft_s")
    itl = truth.get("itl_s")
    chunks = sum(len(r.chunk_times) for r in result.records)
    return Row(
        load=load, layout=layout, round=k, chunks=chunks, chunks_per_s=chunks / result.duration_s,
        records=len(result.records), driver_cpu_s=driver_s,
        worker_cpu_s=sum(w.cpu_s or 0.0 for w in result.workers), ray_cpu_s=ray_s,
        ttft_error_ms=1e3 * (s.ttft.p50 - ttft["p50"]) if s.ttft and ttft else None,
        itl_error_ms=1e3 * (s.itl_per_chunk.p50 - itl["p50"]) if s.itl_per_chunk and itl else None,
        lag_p99_ms=1e3 * s.schedule_lag.p99 if arrival.open_loop and s.schedule_lag else None,
        verdict="valid" if judged.valid else "INVALID: " + "; ".join(judged.reasons))


def _workload(name: str, arrival: Arrival, tokens: int, seconds: float, seed: int) -> Workload:
    """Open loop: the rate for ``seconds``. Closed loop: enough requests to keep every stream busy until the
    deadline, no more (the driver builds, hashes and ships every request of the workload)."""
    request_s = SETTINGS.ttft_s + (tokens - 1) * SETTINGS.interval_s
    n = (int(arrival.rate * seconds) if arrival.open_loop
         else arrival.concurrency * (math.ceil(seconds / request_s) + 1))
    return WorkloadSpec(name, n, prompt=Lengths.fixed(4), output=Lengths.fixed(tokens), arrival=arrival,
                        seed=seed).build()


async def _measured(engine: VLLMEngine, workload: Workload, config: LoadConfig, tmp: Path, url: str, server: set[int],
                    load: str, layout: str, k: int, arrival: Arrival) -> Row:
    """One run, its client CPU split into this process's and Ray's, against the server's own account of it."""
    await selftest.server_truth(url)  # the server forgets what came before: its account is of this run
    # Ray's processes alive from before the run to after it (its daemons and idle workers; the run's own actors
    # report their CPU themselves).
    before = _cpu_s(ray_workers._descendants(os.getpid()) - server)
    cpu = time.process_time()
    result = await run(engine, workload, results_dir=tmp, reset_cache=False, load=config)
    cpu = time.process_time() - cpu
    after = _cpu_s(set(before))
    ray_s = sum(after[p] - before[p] for p in before if after[p] >= before[p] > 0)
    return _row(load, layout, k, result, await selftest.server_truth(url), cpu, ray_s, arrival)


def test_one_local_worker_against_two_on_ray(placed: tuple[str, Any, set[int], str], benchmark: Any) -> None:
    url, cluster, server, where = placed
    rows: list[Row] = []

    async def measure() -> None:
        async with VLLMEngine(model=ModelRef(selftest.MODEL), url=url) as engine:
            with tempfile.TemporaryDirectory(prefix="batchbench-ray-bench-") as tmp:
                warm = WorkloadSpec("warm", 32, prompt=Lengths.fixed(4), output=Lengths.fixed(4),
                                    arrival=Arrival("closed", concurrency=8)).build()
                on_ray = LoadConfig(worker_pool="ray", ray_address=cluster.address, workers=2)
                await run(engine, warm, results_dir=Path(tmp), reset_cache=False)
                await run(engine, warm, results_dir=Path(tmp), reset_cache=False, load=on_ray)
                for k in range(ROUNDS):
                    for load, (arrival, tokens, seconds) in LOADS.items():
                        layouts = ["local", "ray"] if k % 2 == 0 else ["ray", "local"]
                        for layout in layouts:
                            workload = _workload(f"bench-{k}", arrival, tokens, seconds, k)
                            config = LoadConfig(request_timeout_s=60.0, send_until_s=seconds)
                            if layout == "ray":
                                config = LoadConfig(request_timeout_s=60.0, send_until_s=seconds, workers=2,
                                                    worker_pool="ray", ray_address=cluster.address)
                            rows.append(await _measured(engine, workload, config, Path(tmp), url, server,
                                                        load, layout, k, arrival))

    benchmark.pedantic(lambda: eventloop.run(measure()), rounds=1, iterations=1)

    def ms(value: float | None, spec: str = "+.3f") -> str:
        return "-" if value is None else format(value, spec)

    print(f"\n{where}; Ray: 2 nodes of 2 logical CPUs each, on the client's CPU")
    print(f"{'load':>15} {'layout':>6} {'chunks/s':>9} {'us CPU/chunk':>12} {'(driver/workers/ray)':>22} "
          f"{'TTFT err':>9} {'ITL err':>8} {'lag p99':>8}  verdict")
    for row in rows:
        print(f"{row.load:>15} {row.layout:>6} {row.chunks_per_s:9.0f} {1e6 * row.client_cpu_s / row.chunks:12.1f} "
              f"{row.driver_cpu_s:6.2f}/{row.worker_cpu_s:5.2f}/{row.ray_cpu_s:5.2f} s    "
              f"{ms(row.ttft_error_ms):>9} {ms(row.itl_error_ms):>8} {ms(row.lag_p99_ms, '.2f'):>8}  {row.verdict}")
    by = {(row.load, row.layout, row.round): row for row in rows}
    for load in LOADS:
        for k in range(ROUNDS):
            local, on_ray = by[load, "local", k], by[load, "ray", k]
            added = 1e6 * (on_ray.client_cpu_s / on_ray.records - local.client_cpu_s / local.records)
            per_record = [1e6 * row.client_cpu_s / row.records for row in (on_ray, local)]
            print(f"{load}, round {k}: Ray adds {added:.0f} us of client CPU per record ({per_record[0]:.0f} "
                  f"against {per_record[1]:.0f})")
    benchmark.extra_info.update({"placement": where, "rows": [row.__dict__ for row in rows]})
    assert {(row.load, row.layout) for row in rows} == {(load, layout) for load in LOADS
                                                       for layout in ("local", "ray")}


#: The scale benchmark's load: short requests (one token: a record per chunk) from many streams, more records a
#: second than one driver journals, so what limits the run is the client side, not the server's pacing.
SCALE_LOAD = (Arrival("closed", concurrency=256), 1, 3.0)
SCALE_WORKERS = (1, 2, 4)


@pytest.mark.skipif("BATCHBENCH_BENCH_ROUNDS" not in os.environ,
                    reason="a measurement for docs/ray.md, run on request: BATCHBENCH_BENCH_ROUNDS=N pytest "
                           "tests/test_ray_benchmark.py -s (it asserts nothing CI needs)")
def test_records_per_second_from_one_two_and_four_workers(placed: tuple[str, Any, set[int], str],
                                                          benchmark: Any) -> None:
    """The same short-request load from 1, 2 and 4 Ray workers (and one local load generator), each run's records
    a second and where its client CPU went: the driver's per record, the workers' per record, Ray's daemons'. The
    model (docs/ray.md): the client side carries at most (client CPUs) / (CPU per record) records a second, the
    driver's share of that CPU on one core bounding it whatever N is."""
    url, cluster, server, where = placed
    arrival, tokens, seconds = SCALE_LOAD
    rows: list[Row] = []

    async def measure() -> None:
        async with VLLMEngine(model=ModelRef(selftest.MODEL), url=url) as engine:
            with tempfile.TemporaryDirectory(prefix="batchbench-ray-scale-") as tmp:
                for k in range(ROUNDS):
                    layouts = [0, *SCALE_WORKERS] if k % 2 == 0 else [*reversed(SCALE_WORKERS), 0]
                    for n in layouts:
                        workload = _workload(f"scale-{k}", arrival, tokens, seconds, k)
                        config = (LoadConfig(request_timeout_s=60.0, send_until_s=seconds) if n == 0 else
                                  LoadConfig(request_timeout_s=60.0, send_until_s=seconds, workers=n,
                                             worker_pool="ray", ray_address=cluster.address))
                        rows.append(await _measured(engine, workload, config, Path(tmp), url, server,
                                                    "closed c=256, 1 token", "local" if n == 0 else f"ray:{n}", k,
                                                    arrival))

    benchmark.pedantic(lambda: eventloop.run(measure()), rounds=1, iterations=1)
    print(f"\n{where}; Ray: 2 nodes of 2 logical CPUs each, on the client's CPU")
    print(f"{'layout':>7} {'records/s':>9} {'driver us/rec':>13} {'workers us/rec':>14} {'ray us/rec':>10} "
          f"{'client CPU/s':>12} {'rec/s a CPU':>11}  verdict")
    for row in rows:
        per = [1e6 * x / row.records for x in (row.driver_cpu_s, row.worker_cpu_s, row.ray_cpu_s)]
        records_s = row.records / (row.chunks / row.chunks_per_s)
        busy = row.client_cpu_s / (row.chunks / row.chunks_per_s)
        # The records a second one CPU of the client side carries at this run's CPU per record (docs/ray.md's model:
        # records/s = client CPUs busy / CPU per record).
        model = 1e6 / sum(per)
        print(f"{row.layout:>7} {records_s:9.0f} {per[0]:13.0f} {per[1]:14.0f} {per[2]:10.0f} {busy:12.2f} "
              f"{model:11.0f}  {row.verdict}")
    benchmark.extra_info.update({"placement": where, "rows": [row.__dict__ for row in rows]})
    assert {row.layout for row in rows} == {"local", *(f"ray:{n}" for n in SCALE_WORKERS)}
