"""DockerLaunch against a local stub of the Docker Engine API (tests/docker_stub.py).

No Docker daemon or GPU is needed: the stub answers the HTTP calls the docker
SDK makes and records them, so the tests check the exact requests (image,
command, env, GPUs, shm, ports, mounts, labels) and the failure paths.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import signal
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import docker
from batchbench.adapters.base import EngineDied, EngineError, EngineUnreachable
from batchbench.adapters.launch import __main__ as launch_cli
from batchbench.adapters.launch import docker as docker_launch
from batchbench.adapters.launch.cleanup import CleanupRegistry
from batchbench.adapters.launch.docker import LABEL_ENGINE, LABEL_RUN, DockerLaunch, ImagePullError, cleanup_leftovers
from batchbench.adapters.launch.images import load_specs
from batchbench.adapters.served import ServedEngine
from batchbench.core.clock import now
from batchbench.core.config import Capabilities, ModelRef
from batchbench.core.placement import EngineCpus
from batchbench.core.server_metrics import ServerMetrics
from tests.docker_stub import DockerStub

TOKEN = "hf_SeCrEtToKeN_1234567890"
SPECS = load_specs()
GiB = 1024**3


# ------------------------------------------------------------------ fixtures


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HOME", "BATCHBENCH_GPUS", "BATCHBENCH_HF_CACHE",
        "BATCHBENCH_RUN_ID", "BATCHBENCH_IMAGES", "DOCKER_HOST", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def stub():
    with DockerStub() as s:
        yield s


@pytest.fixture
def client(stub: DockerStub):
    c = docker.DockerClient(base_url=stub.base_url, version="1.43")
    yield c
    c.close()


@pytest.fixture
def registry():
    r = CleanupRegistry()
    yield r
    r.teardown()
    r.uninstall()


@pytest.fixture
def make(client, registry, tmp_path: Path):
    def make(engine: str = "vllm", **kwargs) -> DockerLaunch:
        kwargs.setdefault("client", client)
        kwargs.setdefault("run_id", "run1")
        kwargs.setdefault("hf_cache", str(tmp_path / "hf"))
        kwargs.setdefault("registry", registry)
        return DockerLaunch(engine, SPECS[engine], **kwargs)

    return make


class Argv:
    """argv_for that records the address it was given."""

    def __init__(self, model: str = "org/tiny-model") -> None:
        self.model = model
        self.calls: list[tuple[str, int]] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append((host, port))
        return [self.model, "--host", host, "--port", str(port), "--max-num-seqs", "8"]


def create_body(stub: DockerStub) -> dict:
    (call,) = stub.calls_to("POST", "/containers/create")
    return call.body


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------- the happy sequence


async def test_full_sequence_and_every_parameter(stub: DockerStub, make, tmp_path: Path) -> None:
    stub.add_image(SPECS["vllm"].image)
    launch = make("vllm")
    argv = Argv()
    assert launch.dead() == "never started"

    url = await launch.start(argv, {"VLLM_CPU_KVCACHE_SPACE": "4"})

    assert url == "http://127.0.0.1:49153"
    assert argv.calls == [("0.0.0.0", 8000)]
    assert stub.sequence() == [
        "GET /_ping",
        "GET /images/vllm/vllm-openai:v0.32.0/json",
        "POST /containers/create",
        "GET /containers/{id}/json",
        "POST /containers/{id}/start",
        "GET /containers/{id}/json",
    ]
    (create,) = stub.calls_to("POST", "/containers/create")
    assert create.query["name"] == launch.name and launch.name.startswith("batchbench-vllm-run1-")
    body = create.body
    assert body["Image"] == "vllm/vllm-openai:v0.32.0"
    # The image's ENTRYPOINT (vllm serve) stays; the command is only the arguments.
    assert "Entrypoint" not in body
    assert body["Cmd"] == ["org/tiny-model", "--host", "0.0.0.0", "--port", "8000", "--max-num-seqs", "8"]
    assert sorted(body["Env"]) == ["HF_HOME=/root/.cache/huggingface", "VLLM_CPU_KVCACHE_SPACE=4"]
    assert body["Labels"] == {LABEL_RUN: "run1", LABEL_ENGINE: "vllm"}
    assert body["ExposedPorts"] == {"8000/tcp": {}}
    host = body["HostConfig"]
    assert host["PortBindings"] == {"8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": ""}]}
    assert host["DeviceRequests"] == [
        {"Driver": "", "Count": -1, "DeviceIDs": [], "Capabilities": [["gpu"]], "Options": {}}
    ]
    assert host["ShmSize"] == 16 * GiB
    assert "IpcMode" not in host
    assert host["Binds"] == [f"{tmp_path / 'hf'}:/root/.cache/huggingface:rw"]
    assert launch.dead() is None
    assert launch.container_id in launch.registry

    text = await launch.logs(tail=10)
    assert text == "INFO starting server\nWARNING stderr line"
    (logs,) = stub.calls_to("GET", r"/containers/\w+/logs")
    assert logs.query == {"stderr": "1", "stdout": "1", "timestamps": "0", "follow": "0", "tail": "10"}

    n = len(stub.calls)
    await launch.stop()
    after = stub.sequence()[n:]
    assert after[-2:] == ["POST /containers/{id}/stop", "DELETE /containers/{id}"]
    assert stub.calls[-2].query == {"t": "20"}
    assert stub.calls[-1].query["force"] == "True"
    assert stub.containers == {}
    assert launch.container_id not in launch.registry
    assert launch.dead() is not None  # gone now

    described = launch.describe()
    assert described["image"] == "vllm/vllm-openai:v0.32.0"
    assert described["image_id"].startswith("sha256:") and described["image_digests"]
    assert described["pulled"] is False
    assert described["url"] == url and described["gpus"] == "all" and described["shm_size"] == "16g"
    assert described["hf_cache"] == {"host": str(tmp_path / "hf"), "container": "/root/.cache/huggingface"}
    json.dumps(described)  # JSON-able for the results
    # Logs taken at stop() stay readable after removal.
    assert "stderr line" in await launch.logs()


@pytest.mark.parametrize("engine", ["tgi", "trtllm"])
async def test_engine_specific_parameters(stub: DockerStub, make, engine: str, tmp_path: Path) -> None:
    spec = SPECS[engine]
    stub.add_image(spec.image)
    launch = make(engine)
    await launch.start(lambda host, port: ["--model-id", "m", "--hostname", host, "--port", str(port)], {})
    body = create_body(stub)
    host = body["HostConfig"]
    assert body["Image"] == spec.image
    assert body["Cmd"] == [*spec.program, "--model-id", "m", "--hostname", "0.0.0.0", "--port", str(spec.port)]
    assert host["PortBindings"] == {f"{spec.port}/tcp": [{"HostIp": "127.0.0.1", "HostPort": ""}]}
    assert host["Binds"] == [f"{tmp_path / 'hf'}:{spec.hf_home}:rw"]
    assert f"HF_HOME={spec.hf_home}" in body["Env"]
    if engine == "tgi":
        assert body["Cmd"][0] == "--model-id"  # text-generation-launcher is the entrypoint
        assert host["ShmSize"] == GiB and "IpcMode" not in host
        assert spec.hf_home == "/data"
    else:
        assert body["Cmd"][0] == "trtllm-serve"
        assert host["IpcMode"] == "host" and "ShmSize" not in host
        assert host["Ulimits"] == [
            {"Name": "memlock", "Soft": -1, "Hard": -1},
            {"Name": "stack", "Soft": 67108864, "Hard": 67108864},
        ]
    await launch.stop()
    assert stub.containers == {}


@pytest.mark.parametrize(
    ("gpus", "requests"),
    [
        ("0,1", [{"Driver": "", "Count": 0, "DeviceIDs": ["0", "1"], "Capabilities": [["gpu"]], "Options": {}}]),
        (["GPU-abc"], [{"Driver": "", "Count": 0, "DeviceIDs": ["GPU-abc"], "Capabilities": [["gpu"]], "Options": {}}]),
        ("none", None),
    ],
)
async def test_gpu_selection(stub: DockerStub, make, gpus, requests) -> None:
    stub.add_image(SPECS["vllm"].image)
    launch = make(gpus=gpus)
    await launch.start(Argv(), {})
    assert create_body(stub)["HostConfig"].get("DeviceRequests") == requests
    await launch.stop()


async def test_gpu_selection_from_the_environment(stub: DockerStub, make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHBENCH_GPUS", "2")
    stub.add_image(SPECS["vllm"].image)
    launch = make()
    await launch.start(Argv(), {})
    assert create_body(stub)["HostConfig"]["DeviceRequests"][0]["DeviceIDs"] == ["2"]
    await launch.stop()


async def test_the_engine_cpus_are_the_containers_cpuset(stub: DockerStub, make) -> None:
    stub.add_image(SPECS["vllm"].image)
    launch = make(cpus=frozenset({1, 2, 3, 6}))
    await launch.start(Argv(), {})
    assert create_body(stub)["HostConfig"]["CpusetCpus"] == "1-3,6"
    assert launch.describe()["cpuset_cpus"] == "1-3,6"
    assert launch.placement() == EngineCpus("container", frozenset({1, 2, 3, 6}))
    await launch.stop()


async def test_without_cpus_the_container_may_run_anywhere(stub: DockerStub, make) -> None:
    stub.add_image(SPECS["vllm"].image)
    launch = make()
    await launch.start(Argv(), {})
    assert "CpusetCpus" not in create_body(stub)["HostConfig"]
    assert launch.describe()["cpuset_cpus"] is None and launch.placement() == EngineCpus("container")
    await launch.stop()


async def test_hf_cache_can_be_left_unmounted(stub: DockerStub, make) -> None:
    stub.add_image(SPECS["vllm"].image)
    launch = make(mount_hf_cache=False)
    await launch.start(Argv(), {})
    body = create_body(stub)
    assert "Binds" not in body["HostConfig"] and not any(e.startswith("HF_HOME=") for e in body.get("Env", []))
    await launch.stop()


async def test_hf_cache_defaults_to_the_users_cache(stub: DockerStub, client, registry) -> None:
    stub.add_image(SPECS["vllm"].image)
    launch = DockerLaunch("vllm", SPECS["vllm"], client=client, registry=registry)
    await launch.start(Argv(), {})
    expected = str(Path("~/.cache/huggingface").expanduser())
    assert create_body(stub)["HostConfig"]["Binds"] == [f"{expected}:/root/.cache/huggingface:rw"]
    assert create_body(stub)["Labels"][LABEL_RUN] == docker_launch.default_run_id()
    await launch.stop()


# ---------------------------------------------------------------- the token


async def test_hf_token_is_passed_in_but_never_shown(stub: DockerStub, make, monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    stub.add_image(SPECS["vllm"].image)
    stub.log_lines = [(1, f"loading with token {TOKEN}"), (2, "ready")]
    launch = make()
    await launch.start(Argv(), {})

    env = create_body(stub)["Env"]
    assert f"HF_TOKEN={TOKEN}" in env and f"HUGGING_FACE_HUB_TOKEN={TOKEN}" in env

    logs = await launch.logs()
    assert TOKEN not in logs and "loading with token ***" in logs
    described = launch.describe()
    assert TOKEN not in json.dumps(described)
    assert described["env"]["HF_TOKEN"] == "***"
    assert TOKEN not in repr(launch) and TOKEN not in str(launch.__dict__.get("last_logs"))
    await launch.stop()
    assert TOKEN not in (launch.last_logs or "")


async def test_hub_token_alone_is_passed_under_both_names(stub: DockerStub, make, monkeypatch) -> None:
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", TOKEN)
    stub.add_image(SPECS["tgi"].image)
    launch = make("tgi")
    await launch.start(Argv(), {})
    env = create_body(stub)["Env"]
    assert f"HF_TOKEN={TOKEN}" in env and f"HUGGING_FACE_HUB_TOKEN={TOKEN}" in env
    await launch.stop()


async def test_no_token_no_token_env(stub: DockerStub, make) -> None:
    stub.add_image(SPECS["vllm"].image)
    launch = make()
    await launch.start(Argv(), {})
    assert not any(e.startswith(("HF_TOKEN=", "HUGGING_FACE_HUB_TOKEN=")) for e in create_body(stub)["Env"])
    await launch.stop()


async def test_token_is_redacted_from_exceptions(stub: DockerStub, make, monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    stub.add_image(SPECS["vllm"].image)
    stub.start_error = f"OCI runtime create failed: env HF_TOKEN={TOKEN} rejected"
    launch = make()
    with pytest.raises(EngineDied) as info:
        await launch.start(Argv(), {})
    assert TOKEN not in str(info.value) and "***" in str(info.value)

    stub.start_error = None
    stub.start_exit_code = 1
    stub.log_lines = [(2, f"401 Unauthorized for token {TOKEN}")]
    launch = make()
    with pytest.raises(EngineDied) as info:
        await launch.start(Argv(), {})
    assert TOKEN not in str(info.value) and "401 Unauthorized for token ***" in str(info.value)
    assert TOKEN not in await launch.logs()


# ------------------------------------------------------------------ pulling


async def test_pulls_a_missing_image(stub: DockerStub, make) -> None:
    launch = make("trtllm")
    await launch.start(Argv(), {})
    (pull,) = stub.calls_to("POST", "/images/create")
    assert pull.query == {"fromImage": "nvcr.io/nvidia/tensorrt-llm/release", "tag": "1.2.1"}
    assert stub.sequence()[:5] == [
        "GET /_ping",
        "GET /images/nvcr.io/nvidia/tensorrt-llm/release:1.2.1/json",
        "POST /images/create",
        "GET /images/nvcr.io/nvidia/tensorrt-llm/release:1.2.1/json",
        "POST /containers/create",
    ]
    assert launch.describe()["pulled"] is True and launch.pull_s is not None
    await launch.stop()


async def test_present_image_is_not_pulled(stub: DockerStub, make) -> None:
    stub.add_image(SPECS["tgi"].image)
    launch = make("tgi")
    await launch.start(Argv(), {})
    assert stub.calls_to("POST", "/images/create") == []
    await launch.stop()


async def test_pull_error_in_the_stream(stub: DockerStub, make) -> None:
    stub.pull_error = "failed to register layer: no space left on device"
    launch = make()
    with pytest.raises(ImagePullError, match=r"pulling vllm/vllm-openai:v0\.32\.0 failed: .*no space left") as info:
        await launch.start(Argv(), {})
    assert isinstance(info.value, EngineError) and info.value.kind == "image_pull"
    assert stub.calls_to("POST", "/containers/create") == []


async def test_pull_refused(stub: DockerStub, make) -> None:
    stub.pull_status = (404, "pull access denied for vllm/vllm-openai, repository does not exist")
    launch = make()
    with pytest.raises(ImagePullError, match="pull access denied"):
        await launch.start(Argv(), {})
    assert stub.containers == {}


async def test_no_pull_when_disabled(stub: DockerStub, make) -> None:
    launch = make(pull=False)
    with pytest.raises(ImagePullError, match="not on the docker host"):
        await launch.start(Argv(), {})
    assert stub.calls_to("POST", "/images/create") == []


# ---------------------------------------------------------------- failures


async def test_daemon_unreachable(registry) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    for version in ("1.43", None):
        launch = DockerLaunch("vllm", SPECS["vllm"], base_url=url, api_version=version, registry=registry, timeout=5)
        with pytest.raises(EngineUnreachable) as info:
            await launch.start(Argv(), {})
        assert f"docker engine not reachable at {url}" in str(info.value)
        assert info.value.engine == "vllm" and info.value.kind == "cannot_run_here"


async def test_daemon_unreachable_from_docker_host(monkeypatch, registry) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    monkeypatch.setenv("DOCKER_HOST", url)
    launch = DockerLaunch("tgi", SPECS["tgi"], registry=registry, timeout=5)
    with pytest.raises(EngineUnreachable, match=f"docker engine not reachable at {url}"):
        await launch.start(Argv(), {})


async def test_container_exits_at_start(stub: DockerStub, make) -> None:
    stub.add_image(SPECS["vllm"].image)
    stub.start_exit_code = 3
    launch = make()
    with pytest.raises(EngineDied) as info:
        await launch.start(Argv(), {})
    message = str(info.value)
    assert "exited with code 3 at start" in message
    assert "fatal error while loading the model" in message  # the log tail
    assert "exited with code 3" in launch.dead()
    assert launch.exit_code == 3
    assert "fatal error" in await launch.logs()
    # start() failed, so nobody calls stop(): it removed the container itself.
    assert stub.containers == {} and len(launch.registry) == 0
    await launch.stop()  # and stop() is still fine


async def test_container_start_refused_names_the_toolkit(stub: DockerStub, make) -> None:
    stub.add_image(SPECS["vllm"].image)
    stub.start_error = 'could not select device driver "" with capabilities: [[gpu]]'
    launch = make()
    with pytest.raises(EngineDied, match="NVIDIA Container Toolkit"):
        await launch.start(Argv(), {})
    assert stub.containers == {}


async def test_container_dies_while_running(stub: DockerStub, make) -> None:
    stub.add_image(SPECS["vllm"].image)
    launch = make()
    await launch.start(Argv(), {})
    assert launch.dead() is None
    stub.exit_container(launch.container_id, 137, ["torch.OutOfMemoryError: CUDA out of memory"])

    deadline = time.monotonic() + 5
    while launch.dead() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert launch.dead() == f"container {launch.name} exited with code 137"
    assert "CUDA out of memory" in await launch.logs()
    await launch.stop()
    assert stub.containers == {}


async def test_dead_never_waits_for_the_daemon(stub: DockerStub, make) -> None:
    stub.add_image(SPECS["vllm"].image)
    launch = make()
    await launch.start(Argv(), {})

    def inspect_calls() -> int:
        return len(stub.calls_to("GET", r"/containers/\w+/json"))

    before = inspect_calls()
    t0 = time.perf_counter()
    for _ in range(1000):
        assert launch.dead() is None
    assert time.perf_counter() - t0 < 0.5
    await asyncio.sleep(0.2)
    assert inspect_calls() - before <= 1  # at most one refresh per interval
    stub.exit_container(launch.container_id, 1)
    assert await launch.refresh() == f"container {launch.name} exited with code 1"
    await launch.stop()


async def test_stop_is_idempotent_even_if_the_container_is_gone(stub: DockerStub, make) -> None:
    stub.add_image(SPECS["vllm"].image)
    launch = make()
    await launch.start(Argv(), {})
    stub.containers.clear()  # removed behind our back (docker rm -f, or cleanup)
    await launch.stop()
    n = len(stub.calls)
    await launch.stop()
    assert len(stub.calls) == n
    assert len(launch.registry) == 0
    assert launch.dead() is not None


async def test_stop_before_start_is_fine(make) -> None:
    launch = make()
    await launch.stop()
    assert launch.dead() == "never started"
    assert await launch.logs() == "(no container log)"


# ------------------------------------------------------------ leftovers


def test_cleanup_leftovers_removes_only_labelled_containers(stub: DockerStub, client) -> None:
    mine = stub.add_container("bb-run1", {LABEL_RUN: "run1", LABEL_ENGINE: "vllm"})
    stopped = stub.add_container("bb-run1-stopped", {LABEL_RUN: "run1", LABEL_ENGINE: "tgi"}, running=False)
    other_run = stub.add_container("bb-run2", {LABEL_RUN: "run2", LABEL_ENGINE: "vllm"})
    unrelated = stub.add_container("postgres", {"com.example": "db"})
    unlabelled = stub.add_container("someone-elses", {})

    assert sorted(cleanup_leftovers(client, "run1")) == ["bb-run1", "bb-run1-stopped"]
    (listing,) = stub.calls_to("GET", "/containers/json")
    assert listing.query["all"] == "1"
    assert json.loads(listing.query["filters"]) == {"label": [f"{LABEL_RUN}=run1"]}
    assert mine not in stub.containers and stopped not in stub.containers
    assert set(stub.containers) == {other_run, unrelated, unlabelled}

    assert cleanup_leftovers(client) == ["bb-run2"]
    assert set(stub.containers) == {unrelated, unlabelled}
    assert cleanup_leftovers(client) == []


def test_cli_cleanup(stub: DockerStub, capsys) -> None:
    stub.add_container("bb-a", {LABEL_RUN: "r9"})
    keep = stub.add_container("bb-b", {LABEL_RUN: "r8"})
    assert launch_cli.main(["--docker-host", stub.base_url, "cleanup", "--run-id", "r9"]) == 0
    assert "removed 1 batchbench container(s) of run r9: bb-a" in capsys.readouterr().out
    assert set(stub.containers) == {keep}


def test_cli_cleanup_unreachable(capsys) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    assert launch_cli.main(["--docker-host", url, "cleanup"]) == 1
    assert f"docker engine not reachable at {url}" in capsys.readouterr().err


def test_cli_pull_and_images(stub: DockerStub, capsys) -> None:
    stub.add_image(SPECS["tgi"].image)
    assert launch_cli.main(["--docker-host", stub.base_url, "pull", "tgi", "trtllm"]) == 0
    out = capsys.readouterr().out
    assert "tgi: ghcr.io/huggingface/text-generation-inference:3.3.7 already present" in out
    assert "trtllm: nvcr.io/nvidia/tensorrt-llm/release:1.2.1 pulled" in out
    assert [c.query["fromImage"] for c in stub.calls_to("POST", "/images/create")] == [
        "nvcr.io/nvidia/tensorrt-llm/release"
    ]
    assert launch_cli.main(["images"]) == 0
    assert "trtllm\tnvcr.io/nvidia/tensorrt-llm/release:1.2.1\tport 8000\ttrtllm-serve" in capsys.readouterr().out


async def test_registry_removes_containers_on_sigterm(stub: DockerStub, make, registry) -> None:
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        registry.install()
        stub.add_image(SPECS["vllm"].image)
        launch = make()
        await launch.start(Argv(), {})
        assert stub.containers
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):
            if received:
                break
            await asyncio.sleep(0.01)
        assert received == [signal.SIGTERM]  # the previous handler still ran
        assert stub.containers == {}
        (delete,) = stub.calls_to("DELETE", r"/containers/\w+")
        assert delete.query["force"] == "True"
        await launch.stop()  # nothing left to do, and no error
    finally:
        registry.uninstall()
        signal.signal(signal.SIGTERM, previous)


async def test_registry_teardown_at_exit(stub: DockerStub, make, registry) -> None:
    stub.add_image(SPECS["vllm"].image)
    first, second = make(), make()
    await first.start(Argv(), {})
    await second.start(Argv(), {})
    assert sorted(registry.teardown()) == sorted([first.name, second.name])
    assert stub.containers == {} and len(registry) == 0


# ------------------------------------------------- as a ServedEngine's Launch


class HealthServer:
    """A tiny "engine" answering /health, where the stub's published port points."""

    def __init__(self) -> None:
        self.hits = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            disable_nagle_algorithm = True

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                owner.hits += 1
                answers = {
                    "/health": b"",
                    "/metrics": b"",
                    "/info": b'{"model_id": "org/tiny", "version": "stub"}',
                    "/version": b'{"version": "stub"}',
                    "/v1/models": b'{"object": "list", "data": [{"id": "org/tiny", "object": "model"}]}',
                }
                ok = self.path in answers
                body = answers.get(self.path, b"not found")
                self.send_response(200 if ok else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def health():
    server = HealthServer()
    yield server
    server.close()


class MiniEngine(ServedEngine):
    name = "vllm"
    capabilities = Capabilities()

    def server_args(self, batching, *, host: str, port: int) -> list[str]:
        return [self.model.path, "--host", host, "--port", str(port)]

    def normalize(self, samples) -> ServerMetrics:
        return ServerMetrics(t=now())

    async def stream(self, request):  # pragma: no cover - not exercised here
        raise NotImplementedError
        yield


async def test_served_engine_starts_becomes_healthy_and_stops(stub: DockerStub, make, health) -> None:
    stub.add_image(SPECS["vllm"].image)
    stub.host_port = health.port
    engine = MiniEngine(model=ModelRef("org/tiny"), launch=make(), startup_timeout=10)
    async with engine:
        assert engine.base_url == f"http://127.0.0.1:{health.port}"
        assert health.hits >= 1
        assert stub.containers
        assert create_body(stub)["Cmd"] == ["org/tiny", "--host", "0.0.0.0", "--port", "8000"]
        assert engine.describe()["mode"] == "DockerLaunch"
    assert stub.containers == {}
    assert stub.sequence()[-1] == "DELETE /containers/{id}"


async def test_served_engine_removes_the_container_when_the_body_raises(stub: DockerStub, make, health) -> None:
    stub.add_image(SPECS["vllm"].image)
    stub.host_port = health.port
    engine = MiniEngine(model=ModelRef("org/tiny"), launch=make(), startup_timeout=10)
    with pytest.raises(RuntimeError, match="boom"):
        async with engine:
            raise RuntimeError("boom")
    assert stub.containers == {}


async def test_served_engine_reports_a_container_that_dies_before_healthy(stub: DockerStub, make) -> None:
    stub.add_image(SPECS["vllm"].image)
    stub.host_port = free_port()  # nothing answers there
    launch = make()
    engine = MiniEngine(model=ModelRef("org/tiny"), launch=launch, startup_timeout=20)

    async def crash_soon() -> None:
        while launch.container_id is None or launch.container_id not in stub.containers:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        stub.exit_container(launch.container_id, 1, ["ValueError: unsupported model architecture"])

    crasher = asyncio.create_task(crash_soon())
    with pytest.raises(EngineDied) as info:
        async with engine:
            pass
    await crasher
    assert "exited with code 1" in str(info.value)
    assert "unsupported model architecture" in str(info.value)
    assert "unsupported model architecture" in engine.server_log_tail
    assert stub.containers == {}


def _adapter_class(engine: str):
    module = importlib.import_module(f"batchbench.adapters.{engine}")
    for _, obj in inspect.getmembers(module, inspect.isclass):
        if issubclass(obj, ServedEngine) and not inspect.isabstract(obj) and getattr(obj, "name", None) == engine:
            return obj
    pytest.skip(f"adapters.{engine} has no ServedEngine named {engine!r}")


@pytest.mark.parametrize("engine", ["vllm", "tgi", "trtllm"])
async def test_real_adapter_with_docker_launch(stub: DockerStub, make, health, engine: str) -> None:
    try:
        cls = _adapter_class(engine)
    except ModuleNotFoundError:
        pytest.skip(f"adapters/{engine}.py does not exist yet")
    stub.add_image(SPECS[engine].image)
    stub.host_port = health.port
    adapter = cls(model=ModelRef("org/tiny"), launch=make(engine), startup_timeout=10)
    async with adapter:
        assert adapter.base_url == f"http://127.0.0.1:{health.port}"
        (container,) = stub.containers.values()
        copied = {path.rsplit("/", 1)[-1]: data.decode() for path, data in container["files"].items()}
    body = create_body(stub)
    cmd = body["Cmd"]
    assert cmd[: len(SPECS[engine].program)] == list(SPECS[engine].program)
    args = cmd[len(SPECS[engine].program):]
    assert "org/tiny" in args and str(SPECS[engine].port) in args
    assert stub.containers == {}
    # The options files an adapter needs (TensorRT-LLM's YAML) are copied into the container.
    wanted = {path.rsplit("/", 1)[-1]: text for path, text in adapter.server_files(adapter.batching).items()}
    assert copied == wanted
    assert bool(wanted) == (engine == "trtllm")


async def test_for_engine_and_restart(stub: DockerStub, client, registry, tmp_path: Path) -> None:
    launch = DockerLaunch.for_engine("tgi", client=client, registry=registry, hf_cache=str(tmp_path))
    assert launch.spec == SPECS["tgi"]
    with pytest.raises(ValueError, match="no container spec for engine 'nope'"):
        DockerLaunch.for_engine("nope")
    stub.add_image(SPECS["tgi"].image)
    await launch.start(Argv(), {})
    first = launch.name
    await launch.stop()
    await launch.start(Argv(), {})  # the same engine object runs the next batching config
    assert launch.name != first and launch.dead() is None
    assert [c.query["name"] for c in stub.calls_to("POST", "/containers/create")] == [first, launch.name]
    await launch.stop()
    assert stub.containers == {}


def test_image_override_keeps_the_rest_of_the_spec(client) -> None:
    launch = DockerLaunch("vllm", SPECS["vllm"], client=client, image="vllm/vllm-openai:v0.33.0")
    assert launch.spec.image == "vllm/vllm-openai:v0.33.0" and launch.spec.port == SPECS["vllm"].port


async def test_files_are_copied_in_before_the_server_starts(stub: DockerStub, make) -> None:
    stub.add_image(SPECS["trtllm"].image)
    launch = make("trtllm")
    options = "kv_cache_config:\n  enable_block_reuse: false\n"
    await launch.start(Argv(), {}, files={"batchbench-trtllm-options.yaml": options, "/etc/extra.json": "{}"})
    (put,) = stub.calls_to("PUT", r"/containers/\w+/archive")
    assert put.query == {"path": "/"}
    seq = stub.sequence()
    assert seq.index("PUT /containers/{id}/archive") < seq.index("POST /containers/{id}/start")
    (container,) = stub.containers.values()
    # Relative paths land in the image's working directory, where the server runs.
    assert container["files"] == {
        f"/{stub.working_dir.strip('/')}/batchbench-trtllm-options.yaml": options.encode(),
        "/etc/extra.json": b"{}",
    }
    assert launch.describe()["files"] == ["/etc/extra.json", "batchbench-trtllm-options.yaml"]
    await launch.stop()
