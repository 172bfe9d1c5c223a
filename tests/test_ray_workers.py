"""Load-generator workers on a Ray cluster (batchbench.load.ray_workers), against a real multi-node Ray on this
machine (``ray.cluster_utils.Cluster``: a head and a second node, each a raylet of its own with one CPU, so the
placement group's SPREAD puts one worker on each) and the fast stream server.

What must hold: one results document with every record from both nodes, its percentiles those of all of them; the
same partition as local workers; a node killed mid-run costs only its undelivered requests (named), ends nothing
else, and leaves no actor or placement group behind; Ctrl-C and SIGTERM stop every worker and leave no Ray
process of ours; a bad option or address is a usage error within seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench import selftest
from batchbench.adapters.vllm import VLLMEngine
from batchbench.cli import main
from batchbench.core.clock import now
from batchbench.core.config import LoadConfig, ModelRef
from batchbench.core.exits import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from batchbench.core.records import RequestRecord
from batchbench.experiment.workload import Workers
from batchbench.load import ray_workers
from batchbench.load.ray_workers import RAY_MISSING, RayWorkerPool, clock_offset, refusal
from batchbench.load.workers import WORKER_DIED, partition
from batchbench.measures.metrics import summarize
from batchbench.results.document import RunDocument
from batchbench.workload.requests import Arrival, Lengths, Workload, WorkloadSpec
from tests.processes import alive
from tests.signal_state import stoppable

#: Nothing listens here: a usage error must be found before anything tries to reach it.
NOWHERE = ["--engine", "vllm", "--engine-url", "vllm=http://127.0.0.1:9"]
#: The fast server's timing: first token after 20 ms, then one every 10 ms.
SETTINGS = selftest.Settings()

needs_ray = pytest.mark.skipif(ray_workers.unusable(None) == RAY_MISSING, reason="Ray is not installed "
                               "(pip install -e '.[ray]'; bootstrap.sh does)")


# --------------------------------------------------------------------------- without a cluster


def test_the_workers_option_takes_ray() -> None:
    assert Workers.parse("ray:3") == Workers(3, "ray")
    assert Workers.parse("2") == Workers(2, "processes")
    assert Workers.parse("auto") == Workers(None, "processes")


@pytest.mark.parametrize(("extra", "message"), [
    (["--workers", "ray:0"], "--workers: must be at least 1"),
    (["--workers", "ray:x"], "--workers: expected a whole"),
    (["--ray-address", "127.0.0.1:6379"], "--ray-address is the cluster of --workers ray:N"),
    (["--workers", "ray:2", "--ray-address", "head"], "is not HOST:PORT"),
    (["--workers", "ray:2", "--ray-address", "127.0.0.1:9"], "nothing answers at the Ray address 127.0.0.1:9"),
    (["--workers", "ray:2", "--ray-address", "ray://127.0.0.1:10001"], "Ray Client cannot carry the workers' record"),
])
def test_a_bad_ray_option_is_a_usage_error_within_seconds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    started = time.monotonic()
    try:
        code = main(["bench", *NOWHERE, *extra, "--results-dir", str(tmp_path), "--no-report"])
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    assert code == EXIT_USAGE and message in capsys.readouterr().err
    assert time.monotonic() - started < 10  # ray.init alone retries an address that does not answer for minutes
    assert not list(tmp_path.iterdir())


def test_without_ray_the_usage_error_says_what_to_install(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_workers.importlib.util, "find_spec", lambda name: None)
    code = main(["bench", *NOWHERE, "--workers", "ray:2", "--results-dir", str(tmp_path), "--no-report"])
    assert code == EXIT_USAGE and RAY_MISSING in capsys.readouterr().err


@given(offset=st.floats(-5.0, 5.0), sent=st.floats(1e9, 2e9),
       ways=st.lists(st.tuples(st.floats(1e-5, 0.05), st.floats(1e-5, 0.05)), min_size=1, max_size=9))
def test_the_clock_offset_is_within_half_the_least_round_trip(offset: float, sent: float,
                                                              ways: list[tuple[float, float]]) -> None:
    """However the delay splits between the way there and back, the estimate is off by at most half the round
    trip it comes from, and that is the least of the probes'."""
    probes = []
    for there, back in ways:
        probes.append((sent, sent + there + offset, sent + there + back))
        sent += there + back + 0.001
    estimate, rtt = clock_offset(probes)
    assert rtt == pytest.approx(min(a + b for a, b in ways), abs=1e-6)
    assert abs(estimate - offset) <= rtt / 2 + 1e-6


def test_a_worker_elsewhere_is_refused_a_loopback_url_or_another_batchbench() -> None:
    hello = {"ip": "10.0.0.7", "version": ray_workers._version()}
    assert refusal(hello, "http://10.0.0.2:8000", "10.0.0.2") is None
    assert refusal({**hello, "ip": "10.0.0.2"}, "http://127.0.0.1:8000", "10.0.0.2") is None  # the driver's host
    why = refusal(hello, "http://127.0.0.1:8000", "10.0.0.2")
    assert why is not None and "another node (10.0.0.7)" in why and "--engine-url" in why
    why = refusal({**hello, "version": "0.0.1"}, "http://10.0.0.2:8000", "10.0.0.2")
    assert why is not None and "runs batchbench 0.0.1" in why


# --------------------------------------------------------------------------- a two-node cluster


def two_nodes() -> Any:
    """A Ray cluster of two nodes on this machine, one CPU each (workers land one on each node)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    return cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    if ray_workers.unusable(None) == RAY_MISSING:
        pytest.skip("Ray is not installed")
    cluster = two_nodes()
    try:
        yield cluster
    finally:
        ray_workers.disconnect()
        cluster.shutdown()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with selftest.fast_server(SETTINGS) as url:
        yield url


def _ours_left(address: str) -> tuple[list[Any], list[str]]:
    """This namespace's live actors and placement groups not removed, on the cluster at ``address``."""
    ray = ray_workers.connect(address, 1)
    actors = ray.util.list_named_actors(all_namespaces=True)
    groups = [g["name"] for g in ray.util.placement_group_table().values()
              if g["name"].startswith("batchbench-") and g["state"] != "REMOVED"]
    return [a for a in actors if a.get("namespace") == ray_workers.NAMESPACE], groups


@needs_ray
def test_bench_on_two_nodes_writes_one_document_with_every_record(
        cluster: Any, server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    n = 120
    code = main(["bench", "--engine", "vllm", "--engine-url", f"vllm={server}", "--model", selftest.MODEL,
                 "--input-len", "4", "--output-len", "6", "--num-requests", str(n), "--rate", "150", "--warmup", "0",
                 "--workers", "ray:2", "--ray-address", cluster.address, "--results-dir", str(tmp_path),
                 "--no-report"])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert "workers: 2 on Ray, 2 node(s)" in out and "clocks within" in out
    (path,) = tmp_path.glob("bench-*/vllm_*.json")
    doc = RunDocument.load(path)
    assert doc.header.load.worker_pool == "ray" and doc.header.load.ray_address == cluster.address
    assert doc.header.load.workers == 2
    # Every record, once, each sent at its own place in the one schedule.
    workload = WorkloadSpec("bench", n, prompt=Lengths.fixed(4), output=Lengths.fixed(6),
                            arrival=Arrival("poisson", rate=150.0)).build()
    assert sorted(r.request_id for r in doc.records) == sorted(r.request_id for r in workload.requests)
    assert all(r.ok and r.output_tokens == 6 for r in doc.records)
    arrival = {r.request_id: r.arrival_s for r in workload.requests}
    assert all(r.scheduled_s == pytest.approx(arrival[r.request_id], abs=1e-6) for r in doc.records)
    # Each worker on a node of its own, its part the local workers' partition, all of it delivered.
    assert doc.footer is not None
    workers = doc.footer.workers
    assert [w.pool for w in workers] == ["ray", "ray"] and len({w.node for w in workers}) == 2
    parts = partition(workload, 2)
    assert [(w.requests, w.records) for w in workers] == [(len(p.requests), len(p.requests)) for p in parts]
    assert all(w.lost is None and w.clock_rtt_s is not None and w.start_late_s is not None for w in workers)
    # Each worker's own validity figures kept, and combined into the run's as local workers' are.
    loads = [w.client for w in workers]
    assert all(load is not None and load.cpu_s > 0 for load in loads)
    assert doc.footer.client is not None and doc.footer.client.cpu_s >= sum(load.cpu_s for load in loads if load)
    # The percentiles are those of every record (nothing merged from per-worker summaries).
    summary = doc.footer.summary
    assert summary is not None and doc.footer.duration_s is not None
    assert dataclasses.replace(summary, energy=None) == summarize(doc.records, duration_s=doc.footer.duration_s)
    assert _ours_left(cluster.address) == ([], [])


def _engine(url: str) -> VLLMEngine:
    return VLLMEngine(model=ModelRef(selftest.MODEL), url=url)


def _closed(n: int, concurrency: int, tokens: int) -> Workload:
    return WorkloadSpec("closed", n, prompt=Lengths.fixed(4), output=Lengths.fixed(tokens),
                        arrival=Arrival("closed", concurrency=concurrency)).build()


@needs_ray
async def test_stopping_the_run_keeps_every_record_and_stops_every_worker(cluster: Any, server: str) -> None:
    """Ctrl-C cancels the run: each worker is told to stop, and its requests in flight come back cancelled."""
    workload = _closed(60, 4, 200)  # 2 s a request: every worker has requests in flight when the run stops
    config = LoadConfig(worker_pool="ray", ray_address=cluster.address, workers=2)
    async with _engine(server) as engine, RayWorkerPool(engine, workload, workers=2, config=config) as pool:
        run = asyncio.create_task(pool.run())
        await asyncio.sleep(pool.start_lead_s + 1.0)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    kinds = Counter(r.error_kind for r in pool.records)
    assert kinds == {"cancelled": 4}, kinds  # both workers' two streams each, not lost, not failed otherwise
    assert all(w.lost is None for w in pool.reports)
    assert _ours_left(cluster.address) == ([], [])


@needs_ray
async def test_a_node_killed_mid_run_keeps_what_it_delivered_and_names_the_loss(server: str) -> None:
    cluster = two_nodes()
    try:
        victim = next(node for node in cluster.list_all_nodes() if not node.head)
        workload = _closed(40, 4, 30)  # each worker: 2 streams, 20 requests of ~0.3 s
        timeout_s = 10.0
        config = LoadConfig(worker_pool="ray", ray_address=cluster.address, workers=2, request_timeout_s=timeout_s)
        seen: list[RequestRecord] = []
        killed_at: list[float] = []

        async with _engine(server) as engine:
            pool = RayWorkerPool(engine, workload, workers=2, config=config, on_record=seen.append)
            async with pool:
                lost = next(r.index for r in pool._remotes if r.hello["node"] == victim.node_id)
                run = asyncio.create_task(pool.run())
                while len(seen) < 4:
                    await asyncio.sleep(0.02)
                cluster.remove_node(victim, allow_graceful=False)
                killed_at.append(now() - pool.t0)
                records = await run
            left = _ours_left(cluster.address)
        # Every request accounted for once: delivered, or failed as the lost worker's.
        assert Counter(r.request_id for r in records) == Counter(r.request_id for r in workload.requests)
        assert records == seen  # each journalled as it came
        report = pool.reports[lost]
        assert report.lost is not None and report.lost_at_s is not None
        died = [r for r in records if r.error_kind == WORKER_DIED]
        assert len(died) == report.requests - report.records > 0
        assert all(f"worker {lost} (host" in (r.error or "") and "was lost" in (r.error or "") for r in died)
        # The other worker's part went on to the end; the loss was seen well within the request timeout.
        other = pool.reports[1 - lost]
        assert other.lost is None and other.records == other.requests
        assert report.lost_at_s - killed_at[0] < timeout_s
        assert left == ([], [])
    finally:
        ray_workers.disconnect()
        cluster.shutdown()


def _ray_processes() -> set[int]:
    """Pids of Ray's own processes on this machine (GCS, raylets, agents, workers)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if any(mark in cmdline for mark in (b"gcs_server", b"raylet", b"ray::", b"default_worker.py",
                                                b"dashboard/agent.py", b"runtime_env/agent", b"log_monitor.py")):
                found.add(int(entry.name))
    return found


@needs_ray
@pytest.mark.parametrize(("where", "sig"), [("a Ray started by bench", signal.SIGTERM),
                                           ("a cluster at an address", signal.SIGTERM),
                                           ("a cluster at an address", signal.SIGINT)])
def test_a_signal_to_bench_leaves_nothing_of_ours_running(cluster: Any, server: str, tmp_path: Path,
                                                          where: str, sig: signal.Signals) -> None:
    """SIGTERM and Ctrl-C alike: the run is cancelled, its workers send back their requests in flight as
    cancelled, the actors and placement group (and a Ray bench started) go; bench exits 143 or 130."""
    address = ["--ray-address", cluster.address] if where == "a cluster at an address" else []
    before = _ray_processes()
    proc = subprocess.Popen([sys.executable, "-m", "batchbench", "bench", "--engine", "vllm", "--engine-url",
                             f"vllm={server}", "--model", selftest.MODEL, "--input-len", "4", "--output-len",
                             "1000", "--num-requests", "8", "--concurrency", "4", "--warmup", "0", "--workers",
                             "ray:2", *address, "--results-dir", str(tmp_path), "--no-report"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"}, preexec_fn=stoppable)
    try:
        deadline = time.monotonic() + 90
        while not list(tmp_path.glob("bench-*/vllm_*.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2.0)  # into the run: each worker streams requests of 10 s
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    (path,) = tmp_path.glob("bench-*/vllm_*.json")
    doc = RunDocument.load(path)
    assert doc.footer is not None and doc.footer.status == "interrupted"
    # Both workers' streams in flight come back cancelled: SIGTERM finishes the run as Ctrl-C does.
    assert Counter(r.error_kind for r in doc.records) == {"cancelled": 4}
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in out, out
    else:
        assert proc.returncode == EXIT_INTERRUPTED and "interrupted" in out, out
    deadline = time.monotonic() + 20
    while (left := [pid for pid in _ray_processes() - before if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"Ray processes {left} outlived the SIGTERM of batchbench bench"
    assert _ours_left(cluster.address) == ([], [])


def test_the_runs_line_names_where_ray_put_the_workers_and_what_was_lost() -> None:
    from batchbench.experiment.levels import worker_lines
    from batchbench.results.document import WorkerReport

    reports = [WorkerReport(index=0, pool="ray", host="load-a", node="n1", requests=10, records=10,
                            clock_offset_s=-0.0004, clock_rtt_s=0.0006, start_late_s=0.0001),
               WorkerReport(index=1, pool="ray", host="load-b", node="n2", requests=10, records=3,
                            clock_offset_s=0.0002, clock_rtt_s=0.0008, start_late_s=0.012,
                            lost="ActorDiedError: the node died", lost_at_s=4.25)]
    assert worker_lines(reports) == [
        "workers: 2 on Ray, 2 node(s) (load-a, load-b); clocks within 0.40 ms of the driver's (±0.40 ms)",
        "worker 1 (load-b) began 12.0 ms after the start instant",
        "worker 1 (load-b) was LOST at 4.2 s: ActorDiedError: the node died; 3 of its 10 records came back, the "
        "rest are failed (worker_died)"]
    local = [WorkerReport(index=0, pool="processes", host="h", requests=5, records=5)]
    assert worker_lines(local) == []  # local processes that all finished: nothing to say
