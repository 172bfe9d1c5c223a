"""Several load-generator processes (batchbench.load.workers): one clock, an exact schedule, the same figures,
nothing lost and nothing left running when a worker dies or the run is stopped."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.adapters.vllm import VLLMEngine
from batchbench.cli import main
from batchbench.core.config import LoadConfig, ModelRef
from batchbench.core.exits import EXIT_OK, EXIT_USAGE
from batchbench.core.placement import MAX_CPU, CpuPlacement, usable_cpus
from batchbench.core.records import RequestRecord
from batchbench.load import runner
from batchbench.load.pinning import Pinned
from batchbench.load.workers import WORKER_DIED, WorkerPool, auto_workers, partition, shares
from batchbench.measures.machine_load import MachineMeter
from batchbench.results.document import RunDocument
from batchbench.workload.requests import Arrival, Lengths, Request, Workload, WorkloadSpec
from tests.processes import alive
from tests.server_process import serving

TOKEN_DELAY_S = 0.01
#: Nothing listens here: a usage error must be found before anything tries to reach it.
NOWHERE = ["--engine", "vllm", "--engine-url", "vllm=http://127.0.0.1:9"]


@pytest.mark.skipif(sys.platform != "linux", reason="the clock's implementation is Linux's")
def test_perf_counter_is_clock_monotonic() -> None:
    info = time.get_clock_info("perf_counter")
    assert info.monotonic and info.implementation == "clock_gettime(CLOCK_MONOTONIC)"
    before = time.perf_counter()
    monotonic = time.clock_gettime(time.CLOCK_MONOTONIC)
    after = time.perf_counter()
    assert before <= monotonic <= after


def test_another_process_reads_the_same_clock() -> None:
    """A child's reading, taken when the parent says so, falls between the parent's readings around it."""
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.stdin.readline(); "
                              "print(repr(time.perf_counter()), flush=True)"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        before = time.perf_counter()
        child.stdin.write("now\n")
        child.stdin.flush()
        reading = float(child.stdout.readline())
        after = time.perf_counter()
    finally:
        child.wait(timeout=10)
    assert before <= reading <= after


def _workload(n: int, arrival: Arrival, times: list[float] | None = None) -> Workload:
    spec = WorkloadSpec("w", n, arrival=arrival)
    times = times or [0.0] * n
    return Workload(spec, tuple(Request(f"r{i}", (3,), 1 + i % 5, arrival_s=times[i]) for i in range(n)))


arrivals = st.one_of(
    st.builds(Arrival, st.just("offline")),
    st.builds(Arrival, st.just("poisson"), rate=st.floats(0.1, 1000)),
    st.builds(Arrival, st.just("closed"), concurrency=st.integers(1, 64)),
)


@given(n=st.integers(1, 80), arrival=arrivals, workers=st.integers(1, 9),
       times=st.lists(st.floats(0, 100, allow_nan=False), min_size=80, max_size=80))
def test_partition_sends_every_request_once_at_its_own_time(n: int, arrival: Arrival, workers: int,
                                                           times: list[float]) -> None:
    workload = _workload(n, arrival, sorted(times)[:n])
    parts = partition(workload, workers)
    assert 1 <= len(parts) <= workers
    sent = [r for part in parts for r in part.requests]
    assert sorted(sent, key=lambda r: r.request_id) == sorted(workload.requests, key=lambda r: r.request_id)
    order = {r.request_id: i for i, r in enumerate(workload.requests)}
    for part in parts:
        assert part.requests  # a worker with nothing to send would only cost its start
        assert [order[r.request_id] for r in part.requests] == sorted(order[r.request_id] for r in part.requests)
        assert part.arrival.kind == arrival.kind
    if arrival.kind == "closed":
        concurrency = [p.arrival.concurrency for p in parts]
        assert sum(concurrency) == arrival.concurrency and max(concurrency) - min(concurrency) <= 1
        if n >= arrival.concurrency:  # each part's requests follow its share of the concurrency
            for part in parts:
                assert abs(len(part.requests) - n * part.arrival.concurrency / arrival.concurrency) < \
                    part.arrival.concurrency + 1
    else:
        assert max(len(p.requests) for p in parts) - min(len(p.requests) for p in parts) <= 1


def test_static_waves_are_sent_from_one_process() -> None:
    with pytest.raises(ValueError, match="static waves"):
        partition(_workload(8, Arrival("waves", concurrency=4)), 2)


@pytest.mark.parametrize(("total", "parts", "expected"), [(10, 4, [3, 3, 2, 2]), (2, 2, [1, 1]), (7, 1, [7])])
def test_shares(total: int, parts: int, expected: list[int]) -> None:
    assert shares(total, parts) == expected


def test_auto_workers_follows_the_expected_load() -> None:
    assert auto_workers(_workload(10, Arrival("closed", concurrency=8)), cores=16) == 1
    assert auto_workers(_workload(10, Arrival("closed", concurrency=600)), cores=16) == 3
    assert auto_workers(_workload(10, Arrival("closed", concurrency=600)), cores=2) == 2
    heavy = Workload(WorkloadSpec("w", 4, arrival=Arrival("poisson", rate=100.0)),
                     tuple(Request(f"r{i}", (3,), 500) for i in range(4)))
    assert auto_workers(heavy, cores=16) == 3  # 100/s x 500 tokens = 50k chunks/s
    assert auto_workers(_workload(8, Arrival("waves", concurrency=8)), cores=16) == 1


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serving("batchbench.fixtures.protocol", "vllm", "--model", "fake-model", "--token-delay",
                 str(TOKEN_DELAY_S), "--max-running", "64", "--max-queue", "256") as url:
        yield url


@pytest.fixture
async def engine(server: str) -> AsyncIterator[VLLMEngine]:
    async with VLLMEngine(model=ModelRef("fake-model"), url=server) as engine:
        yield engine


def _no_workers_left() -> bool:
    return not [p for p in multiprocessing.active_children() if p.name.startswith("batchbench-worker")]


async def test_one_worker_and_two_measure_the_same(engine: VLLMEngine, tmp_path: Path) -> None:
    """On a load one worker carries, two give the same requests, tokens and latencies, on the exact schedule."""
    workload = WorkloadSpec("light", 24, prompt=Lengths.fixed(8), output=Lengths.fixed(20),
                            arrival=Arrival("poisson", rate=30.0), seed=3).build()
    one = await runner.run(engine, workload, results_dir=tmp_path, tag="one")
    two = await runner.run(engine, workload, results_dir=tmp_path, tag="two", load=LoadConfig(workers=2))
    assert _no_workers_left()
    for result in (one, two):
        assert result.summary.requests == result.summary.ok == 24
        assert sorted(r.output_tokens for r in result.records) == [20] * 24
        arrival = {r.request_id: r.arrival_s for r in workload.requests}
        assert all(r.scheduled_s == pytest.approx(arrival[r.request_id], abs=1e-9) for r in result.records)
    a, b = one.summary, two.summary
    assert a.ttft is not None and b.ttft is not None and a.itl is not None and b.itl is not None
    # Latencies are the server's pacing (TOKEN_DELAY_S a step) plus this machine's noise: loose on purpose.
    assert abs(a.ttft.p50 - b.ttft.p50) <= max(0.05, 0.5 * a.ttft.p50)
    assert 0.7 <= b.itl.p50 / a.itl.p50 <= 1.4
    assert RunDocument.load(two.path).header.load.workers == 2
    assert RunDocument.load(one.path).header.load.workers == 1
    assert two.client.cpu_s > 0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(usable_cpus()) < 2,
                    reason="needs CPU affinity and two usable CPUs")
async def test_each_worker_pins_itself_to_its_own_client_cpu(engine: VLLMEngine) -> None:
    first, second = sorted(usable_cpus())[:2]
    # Worker 0 on the second CPU, worker 1 on the first; the engine's share is not the pool's to apply.
    placement = CpuPlacement(frozenset({MAX_CPU - 1}), (second, first))
    async with WorkerPool(engine, _closed(4, 2, 4), workers=2, placement=placement) as pool:
        pids = sorted(pool.pids)
        assert pool.pinned == [Pinned(frozenset({second})), Pinned(frozenset({first}))]
        assert sorted(tuple(os.sched_getaffinity(pid)) for pid in pids) == [(first,), (second,)]
        records = await pool.run()
    assert all(r.ok for r in records)
    async with WorkerPool(engine, _closed(4, 2, 4), workers=2) as pool:  # no placement: as the parent runs
        assert pool.pinned == [Pinned(frozenset(os.sched_getaffinity(0)))] * 2


def _closed(n: int, concurrency: int, tokens: int) -> Workload:
    return WorkloadSpec("closed", n, prompt=Lengths.fixed(8), output=Lengths.fixed(tokens),
                        arrival=Arrival("closed", concurrency=concurrency)).build()


async def test_a_worker_killed_mid_run_keeps_what_was_measured(engine: VLLMEngine) -> None:
    workload = _closed(16, 4, 30)  # each worker: 2 streams, 8 requests of ~0.3 s
    seen: list[RequestRecord] = []

    def kill_first_worker(record: RequestRecord) -> None:
        seen.append(record)
        if len(seen) == 1:
            victim = next(p for p in multiprocessing.active_children() if p.name == "batchbench-worker-0")
            os.kill(victim.pid, signal.SIGKILL)

    async with WorkerPool(engine, workload, workers=2, on_record=kill_first_worker) as pool:
        records = await pool.run()
    assert _no_workers_left()
    assert Counter(r.request_id for r in records) == Counter(r.request_id for r in workload.requests)
    lost = [r for r in records if r.error_kind == WORKER_DIED]
    assert lost and all("worker 0" in (r.error or "") and "SIGKILL" in (r.error or "") for r in lost)
    assert sum(r.ok for r in records) >= 8  # worker 1's part, and whatever worker 0 finished first
    assert records == seen and len(pool.client_loads) == 1


async def test_stopping_the_run_keeps_every_record_and_leaves_no_process(engine: VLLMEngine) -> None:
    """Ctrl-C or SIGTERM cancels the run: the requests in flight come back as cancelled records."""
    workload = _closed(40, 4, 30)
    async with WorkerPool(engine, workload, workers=2) as pool:
        assert len(pool.pids) == 2  # the harness, not other work on the machine
        # Unknown to the meter, the workers are other work; told, they are the load generator's.
        assert {MachineMeter(frozenset())._processes()[pid][0] for pid in pool.pids} == {"other"}
        assert {MachineMeter(frozenset(), pool.pids)._processes()[pid][0] for pid in pool.pids} == {"client"}
        run = asyncio.create_task(pool.run())
        while not pool.records:
            await asyncio.sleep(0.02)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        kinds = Counter(r.error_kind for r in pool.records)
        assert kinds[None] >= 1 and kinds["cancelled"] >= 2  # each worker had streams in flight
        assert len({r.request_id for r in pool.records}) == len(pool.records) < 40
    assert _no_workers_left()


def test_bench_sends_from_the_workers_asked_for(server: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--engine", "vllm", "--engine-url", f"vllm={server}", "--input-len", "8", "--output-len",
                 "5", "--num-requests", "12", "--concurrency", "4", "--workers", "2", "--results-dir", str(tmp_path),
                 "--no-report"])
    assert code == EXIT_OK, capsys.readouterr()
    (doc,) = tmp_path.glob("bench-*/vllm_*.json")
    run = RunDocument.load(doc)
    assert run.header.load.workers == 2 and len(run.records) == 12 and all(r.ok for r in run.records)
    assert run.footer is not None and [(w.pool, w.records, w.lost) for w in run.footer.workers] == [
        ("processes", 6, None), ("processes", 6, None)]
    assert _no_workers_left()


@pytest.mark.parametrize(("extra", "message"), [
    ([*NOWHERE, "--workers", "0"], "--workers: must be at least 1"),
    ([*NOWHERE, "--workers", "many"], "--workers: expected a whole"),
])
def test_a_bad_workers_option_is_a_usage_error_before_any_engine_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    try:
        code = main(["bench", *extra, "--results-dir", str(tmp_path), "--no-report"])
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    assert code == EXIT_USAGE and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def _workers_of(pid: int) -> list[int]:
    """The spawned worker processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and b"multiprocessing.spawn" in (entry / "cmdline").read_bytes()
                    and (entry / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(pid)):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return found


def test_sigterm_to_bench_leaves_no_worker_process(server: str, tmp_path: Path) -> None:
    """A killed parent closes its end of every worker's pipe: each worker stops at once (SIGKILL included)."""
    proc = subprocess.Popen([sys.executable, "-m", "batchbench", "bench", "--engine", "vllm", "--engine-url",
                             f"vllm={server}", "--input-len", "8", "--output-len", "1500", "--num-requests", "8",
                             "--concurrency", "4", "--workers", "2", "--results-dir", str(tmp_path), "--no-report"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(workers := _workers_of(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(workers) == 2, "bench never started its two workers"
        time.sleep(2)  # into the run: each worker streams requests (of 15 s each) and waits on no pipe
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM  # finished as Ctrl-C finishes it
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while (left := [pid for pid in workers if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"worker processes {left} outlived the SIGTERM of batchbench bench"
