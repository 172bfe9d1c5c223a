"""Load from many hosts across a real network: a Ray cluster of containers, each with an IP of its own on one Docker
network: a head and two worker nodes of two CPUs each, the engine (the fast stream server) in a container of its
own, and the driver, ``batchbench bench --workers ray:N --ray-address head:6379``, on a node of no CPUs in a
container of its own, as a client machine joins a cluster (``ray start --num-cpus 0``) or ``ray job submit`` runs it.

tests/test_ray_workers.py runs the same code on raylets of one host, which share its IP and its loopback; here what
only a network shows is checked: records streamed between nodes, the loopback refusal for workers elsewhere, a node
whose container is killed (not an actor that exits), and a head that disappears under its driver. The image is
``docker/images.sh ray``: the protocol image (this checkout's batchbench) with this host's Ray version.

Why the driver is not this host's own process: Ray Client (``ray://``) cannot stream records
(:data:`batchbench.load.ray_workers.RAY_CLIENT_REFUSED`), and a driver joined to the cluster from this host finds the
containers' raylets in its own process table (one kernel) and takes the head's for its own, an artefact of
containers that separate hosts do not have.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchbench import selftest
from batchbench.core.exits import EXIT_FAILURES, EXIT_OK, EXIT_USAGE
from batchbench.load.workers import WORKER_DIED
from batchbench.measures.metrics import summarize
from batchbench.results.document import RunDocument
from tests.docker_engine import build_images, engine_client

pytestmark = pytest.mark.docker_engine

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
IMAGE = f"batchbench-ray:{ray.__version__}"
ENGINE_PORT = 8000
#: Logical CPUs each worker-capable node offers: with three, ``ray:4`` spreads over all of them.
NODE_CPUS = 2
#: A run's requests at 40/s: ~5 s of sending, long enough to kill a node in the middle of it.
REQUESTS, RATE = 200, 40.0
#: Tokens per request from the fast server, a token every 20 ms (~0.2 s a request).
TOKENS = 10
#: Where the driver container writes its results (this module's folder, mounted).
RESULTS = "/results"


#: Every process's command line, in a container without ps (Debian's minbase has no procps).
_COMMAND_LINES = ("import pathlib\nfor p in pathlib.Path('/proc').glob('[0-9]*/cmdline'):\n    try:\n"
                  "        print(p.read_bytes().replace(b'\\0', b' ').decode())\n    except OSError:\n        pass")


@dataclasses.dataclass
class Cluster:
    """The containers of one test module, by role, on their own network; removed together at the end."""

    client: Any
    network: Any
    results: Path
    containers: dict[str, Any] = dataclasses.field(default_factory=dict)

    def ip(self, role: str) -> str:
        self.containers[role].reload()
        return str(self.containers[role].attrs["NetworkSettings"]["Networks"][self.network.name]["IPAddress"])

    def start(self, role: str, command: list[str], **options: Any) -> None:
        self.containers[role] = self.client.containers.run(
            IMAGE, command, name=f"{self.network.name}-{role}", hostname=role, network=self.network.name,
            detach=True, shm_size="512m", labels={"batchbench.test": self.network.name}, **options)

    def ray_nodes(self) -> int:
        """Nodes alive as the head counts them: ``ray status``'s "Active:" lines (``ray list`` needs the dashboard,
        which the head runs without)."""
        code, out = self.containers["head"].exec_run(["ray", "status"])
        return len(re.findall(rb"^ 1 node_", out, re.MULTILINE)) if code == 0 else 0

    def bench(self, folder: str, *, workers: int = 4, url: str | None = None) -> subprocess.Popen[str]:
        """``batchbench bench`` on the driver node against the engine's container, its workers on the others."""
        url = url or f"http://{self.ip('engine')}:{ENGINE_PORT}"
        return subprocess.Popen(
            ["docker", "exec", self.containers["driver"].name, "/opt/venv/bin/batchbench", "bench", "--engine", "vllm",
             "--engine-url", f"vllm={url}", "--model", selftest.MODEL,
             "--input-len", "4", "--output-len", str(TOKENS), "--num-requests", str(REQUESTS), "--rate", str(RATE),
             "--warmup", "0", "--workers", f"ray:{workers}", "--ray-address", "head:6379", "--request-timeout", "30",
             "--results-dir", f"{RESULTS}/{folder}", "--no-report"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def batchbench_left(self) -> list[str]:
        """Processes of batchbench still running on the driver node."""
        _, out = self.containers["driver"].exec_run(["python3", "-c", _COMMAND_LINES])
        return [line for line in out.decode(errors="replace").splitlines() if "batchbench bench" in line]

    def remove(self) -> None:
        mine = {"label": f"batchbench.test={self.network.name}"}
        for container in self.client.containers.list(all=True, filters=mine):
            container.remove(force=True)
        self.network.remove()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    client = engine_client()
    build_images("ray")
    network = client.networks.create(f"batchbench-ray-{uuid.uuid4().hex[:8]}", driver="bridge")
    made = Cluster(client, network, tmp_path_factory.mktemp("ray-cluster"))
    try:
        made.start("engine", ["-m", "batchbench.fixtures.protocol.fast", "--host", "0.0.0.0", "--port",
                              str(ENGINE_PORT), "--model", selftest.MODEL, "--interval", "0.02"],
                   entrypoint=["/opt/venv/bin/python3"])
        made.start("head", ["start", "--head", "--block", f"--num-cpus={NODE_CPUS}", "--include-dashboard=false",
                            "--disable-usage-stats"])
        for worker in ("worker-1", "worker-2"):
            made.start(worker, ["start", "--block", f"--num-cpus={NODE_CPUS}", "--address=head:6379",
                                "--disable-usage-stats"])
        made.start("driver", ["start", "--block", "--num-cpus=0", "--address=head:6379", "--disable-usage-stats"],
                   volumes={str(made.results): {"bind": RESULTS, "mode": "rw"}})
        deadline = time.monotonic() + 120
        while made.ray_nodes() < 4:
            assert time.monotonic() < deadline, "the Ray cluster of containers did not come up within 120 s:\n" + \
                made.containers["head"].logs().decode(errors="replace")[-2000:]
            time.sleep(1)
        yield made
    finally:
        made.remove()
        client.close()


def wait_for_records(folder: Path, proc: subprocess.Popen[str], n: int, timeout_s: float = 120) -> None:
    """Until the run's journal holds ``n`` records: the run is sending (its output is read at the end)."""
    deadline = time.monotonic() + timeout_s
    while sum(path.read_bytes().count(b'"type":"record"') for path in folder.glob("bench-*/vllm_*")) < n:
        assert proc.poll() is None, f"bench ended before sending: {proc.communicate()[0]}"
        assert time.monotonic() < deadline, f"no {n} records within {timeout_s:g}s"
        time.sleep(0.2)


def document(folder: Path, out: str) -> RunDocument:
    """The run's document, folded from its journal when the run ended (the output says why where it was not)."""
    found = list(folder.glob("bench-*/vllm_*.json"))
    assert len(found) == 1, f"{[p.name for p in folder.glob('bench-*/*')]}\n{out}"
    return RunDocument.load(found[0])


def test_a_run_from_three_nodes_writes_one_document_with_every_record(cluster: Cluster) -> None:
    proc = cluster.bench("three")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == EXIT_OK, out
    doc = document(cluster.results / "three", out)
    assert doc.footer is not None and doc.footer.summary is not None and doc.footer.duration_s is not None
    assert len(doc.records) == REQUESTS and all(r.ok and r.output_tokens == TOKENS for r in doc.records)
    # Four workers over the three nodes with CPUs, each named with its IP on the network; none on the driver's.
    workers = doc.footer.workers
    assert [w.pool for w in workers] == ["ray"] * 4
    ips = {cluster.ip(role) for role in ("head", "worker-1", "worker-2")}
    assert {w.ip for w in workers} == ips, [dataclasses.asdict(w) for w in workers]
    assert all(w.lost is None and w.records == w.requests for w in workers)
    # Each worker's clock offset against the driver's, with the round trip that bounds it.
    assert all(w.clock_offset_s is not None and w.clock_rtt_s is not None and w.clock_rtt_s > 0 for w in workers)
    # The summary is the one computed from every record (nothing merged from the workers' own summaries).
    assert dataclasses.replace(doc.footer.summary, energy=None) == summarize(doc.records,
                                                                            duration_s=doc.footer.duration_s)
    assert "workers: 4 on Ray, 3 node(s)" in out and all(ip in out for ip in ips), out


def test_a_loopback_engine_url_is_refused_for_workers_elsewhere(cluster: Cluster) -> None:
    started = time.monotonic()
    proc = cluster.bench("loopback", url=f"http://127.0.0.1:{ENGINE_PORT}", workers=2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != EXIT_OK, out
    assert "loopback" in out, out
    sent = [r for p in (cluster.results / "loopback").glob("bench-*/vllm_*.json") for r in RunDocument.load(p).records
            if r.ok]
    assert not sent, out
    assert time.monotonic() - started < 60, out


def test_a_worker_node_killed_mid_run_keeps_what_was_delivered_and_names_the_node(cluster: Cluster) -> None:
    folder = cluster.results / "node-killed"
    proc = cluster.bench("node-killed")
    wait_for_records(folder, proc, 20)
    victim_ip = cluster.ip("worker-1")
    cluster.containers["worker-1"].kill()
    killed = time.monotonic()
    out = proc.communicate(timeout=180)[0]
    ended = time.monotonic()
    assert proc.returncode == EXIT_FAILURES, out
    doc = document(folder, out)
    assert doc.footer is not None
    # Every request accounted for once: delivered, or failed as the lost node's, naming it.
    assert len(doc.records) == REQUESTS and len({r.request_id for r in doc.records}) == REQUESTS
    lost = [w for w in doc.footer.workers if w.lost is not None]
    assert lost and all(w.ip == victim_ip for w in lost), [dataclasses.asdict(w) for w in doc.footer.workers]
    died = [r for r in doc.records if r.error_kind == WORKER_DIED]
    assert len(died) == sum(w.requests - w.records for w in lost) > 0
    assert all(victim_ip in (r.error or "") and "was lost" in (r.error or "") for r in died)
    # The others went on to the end; one line says which node was lost, and when.
    assert all(w.records == w.requests for w in doc.footer.workers if w.lost is None)
    assert re.search(rf"{re.escape(victim_ip)}\) was LOST at \d", out), out
    print(f"worker node killed: the run ended {ended - killed:.1f} s later")
    assert ended - killed < 60, out


def test_the_head_killed_mid_run_ends_the_run_within_seconds_keeping_what_was_delivered(cluster: Cluster) -> None:
    folder = cluster.results / "head-killed"
    proc = cluster.bench("head-killed", workers=2)
    wait_for_records(folder, proc, 20)
    cluster.containers["head"].kill()
    killed = time.monotonic()
    try:
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    ended = time.monotonic()
    assert proc.returncode in (EXIT_FAILURES, EXIT_USAGE), out
    doc = document(folder, out)
    assert [r for r in doc.records if r.ok], out
    assert Counter(r.request_id for r in doc.records).most_common(1)[0][1] == 1
    print(f"head killed: the run ended {ended - killed:.1f} s later")
    assert ended - killed < 45, out
    assert cluster.batchbench_left() == []
