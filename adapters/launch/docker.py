"""Launching an engine server in a Docker container on a GPU host.

:class:`DockerLaunch` is the :class:`batchbench.adapters.launch.Launch` for the
containerised engines (vLLM, TGI, TensorRT-LLM). Images, ports and the other
per-engine facts come from ``images.toml``
(:func:`batchbench.adapters.launch.images.load_specs`), the one place image
tags are pinned.

Every container batchbench starts carries the labels ``batchbench.run=<run
id>`` and ``batchbench.engine=<name>``; :func:`cleanup_leftovers` (also
``python -m batchbench.adapters.launch cleanup``) removes what a killed run
left behind. Containers this process started are registered with
:data:`batchbench.adapters.launch.cleanup.REGISTRY`, so SIGINT, SIGTERM,
SIGHUP and interpreter exit remove them.

A local model folder (``model_dir``) is mounted read-only at :data:`MODEL_MOUNT`, the path the engine is given.
Images named ``batchbench-*`` are built on the Docker host by ``docker/images.sh`` from local files and are on no
registry: one that is missing fails at once, saying how to build it, instead of trying a pull.

The Hugging Face token (``HF_TOKEN`` / ``HUGGING_FACE_HUB_TOKEN``) is passed
into the container when the caller's environment has it, and redacted from
everything this module reports: :meth:`DockerLaunch.describe`, ``repr``,
exception messages and the captured logs.

The docker SDK is synchronous; every call runs in a worker thread. This module
is named after what it drives; ``import docker`` (absolute) still means the SDK.
"""

from __future__ import annotations

import asyncio
import functools
import io
import logging
import os
import posixpath
import tarfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchbench.adapters.base import EngineCannotRunHere, EngineDied
from batchbench.adapters.launch.cleanup import REGISTRY, CleanupRegistry
from batchbench.adapters.launch.images import ContainerSpec, load_specs, specs_path
from batchbench.adapters.launch.secrets import is_secret_name, redact, redact_env, token_env
from batchbench.core.placement import EngineCpus, format_cpu_list, parse_cpu_list

if TYPE_CHECKING:  # pragma: no cover
    import docker

log = logging.getLogger(__name__)

LABEL_RUN = "batchbench.run"
LABEL_ENGINE = "batchbench.engine"
#: Where a local model folder is mounted (read-only) in the container; the engine is given this path.
MODEL_MOUNT = "/model"
#: The name prefix of the images ``docker/images.sh`` builds here; no registry has them.
LOCAL_IMAGE_PREFIX = "batchbench-"


class ImagePullError(EngineCannotRunHere):
    """The engine's image is not on the Docker host and could not be pulled: this environment cannot run it (a
    skip with the reason in the suites; ``--require-engines`` makes it a failure)."""

    kind = "image_pull"


def image_hint(image: str) -> str:
    """How to get ``image`` onto the Docker host: batchbench's own images are built by ``docker/images.sh``, the
    engines' pinned ones pulled where their registry answers."""
    name = image.rsplit("/", 1)[-1].split(":", 1)[0].split("@", 1)[0]
    if name.startswith(LOCAL_IMAGE_PREFIX):
        return (f"build it on the docker host with docker/images.sh {name.removeprefix(LOCAL_IMAGE_PREFIX)} (from "
                "Debian's packages and local wheels; no registry needed)")
    return (f"pull it where its registry is reachable (docker pull {image}, or python -m batchbench.adapters.launch "
            "pull), or bring it with docker save / docker load")


# -------------------------------------------------------------------------- client


def _docker() -> Any:
    try:
        import docker
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("the docker SDK is not installed: pip install 'batchbench[docker]'") from exc
    return docker


def docker_host(base_url: str | None = None) -> str:
    """Where the Docker Engine is expected, for messages."""
    return base_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def make_client(
    base_url: str | None = None, *, version: str | None = None, timeout: float = 120.0
) -> docker.DockerClient:
    """A DockerClient for ``base_url``, or from the environment (DOCKER_HOST, DOCKER_TLS_VERIFY, ...).

    ``version=None`` negotiates the API version with the daemon. Raises the
    SDK's exceptions; :class:`DockerLaunch` turns them into EngineUnreachable.
    """
    docker = _docker()
    if base_url is None:
        return docker.from_env(version=version or "auto", timeout=int(timeout))
    return docker.DockerClient(base_url=base_url, version=version or "auto", timeout=int(timeout))


def connect(engine: str, base_url: str | None, version: str | None, timeout: float) -> docker.DockerClient:
    """A client whose daemon answered a ping, or EngineUnreachable."""
    try:
        client = make_client(base_url, version=version, timeout=timeout)
        client.ping()
    except Exception as exc:
        raise EngineCannotRunHere(engine, f"docker engine not reachable at {docker_host(base_url)}: {exc}") from exc
    return client


def _force_remove(client: docker.DockerClient, container_id: str) -> None:
    """Remove a container whatever its state; one that is already gone is fine (the cleanup callback)."""
    try:
        client.api.remove_container(container_id, force=True)
    except Exception as exc:
        if "No such container" in str(exc) or getattr(exc, "status_code", None) == 404:
            return
        raise


def cleanup_leftovers(client: docker.DockerClient, run_id: str | None = None) -> list[str]:
    """Force-remove batchbench's containers (of one run, or all); return their names."""
    label = f"{LABEL_RUN}={run_id}" if run_id else LABEL_RUN
    removed = []
    for summary in client.api.containers(all=True, filters={"label": label}):
        labels = summary.get("Labels") or {}
        if LABEL_RUN not in labels or (run_id is not None and labels[LABEL_RUN] != run_id):
            continue  # trust, but check: never remove what is not ours
        names = summary.get("Names") or [summary["Id"][:12]]
        name = names[0].lstrip("/")
        try:
            client.api.remove_container(summary["Id"], force=True)
        except Exception as exc:
            if getattr(exc, "status_code", None) != 404:
                raise
        REGISTRY.discard(summary["Id"])
        removed.append(name)
    return removed


def default_run_id() -> str:
    """``$BATCHBENCH_RUN_ID``, else one id per process."""
    return os.environ.get("BATCHBENCH_RUN_ID") or _PROCESS_RUN_ID


_PROCESS_RUN_ID = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def parse_gpus(value: str | Iterable[str] | None) -> list[str] | None:
    """"all" → None (every GPU), "none"/"" → [] (no GPU), "0,1" or a list → those device ids."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "all":
            return None
        if text in ("", "none"):
            return []
        return [part.strip() for part in value.split(",") if part.strip()]
    return [str(v) for v in value]


# -------------------------------------------------------------------------- launch


class DockerLaunch:
    """Runs an engine's server in a container; a :class:`batchbench.adapters.launch.Launch`.

    ``start()`` pulls the image if the Docker host lacks it, creates the
    container (GPUs, /dev/shm, IPC, ulimits, the HF cache mounted, labels),
    copies in the files the server needs (:attr:`files`, e.g. TensorRT-LLM's
    options YAML), starts it, and returns
    ``http://127.0.0.1:<ephemeral host port>``. ``stop()`` always removes
    the container.
    """

    #: dead() asks the daemon at most this often; it never waits for the answer.
    refresh_interval = 0.5

    def __init__(
        self,
        engine: str,
        spec: ContainerSpec | None = None,
        *,
        client: docker.DockerClient | None = None,
        base_url: str | None = None,
        api_version: str | None = None,
        timeout: float = 120.0,
        run_id: str | None = None,
        gpus: str | Iterable[str] | None = None,
        hf_cache: str | os.PathLike[str] | None = None,
        mount_hf_cache: bool = True,
        publish_ip: str = "127.0.0.1",
        url_host: str | None = None,
        image: str | None = None,
        stop_timeout: int = 20,
        pull: bool = True,
        cpus: frozenset[int] | None = None,
        registry: CleanupRegistry | None = None,
        model_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        """``cpus``: the engine's CPUs (a placement's ``engine_cpus``), the container's cpuset; None: any.
        ``model_dir``: a model folder on the Docker host, mounted read-only at :data:`MODEL_MOUNT`."""
        spec = spec if spec is not None else load_specs()[engine]
        if image is not None:
            spec = replace(spec, image=image)
        self.engine = engine
        self.spec = spec
        self.base_url = base_url
        self.api_version = api_version
        self.timeout = timeout
        self.run_id = run_id or default_run_id()
        self.gpus = parse_gpus(gpus if gpus is not None else os.environ.get("BATCHBENCH_GPUS", "all"))
        cache = hf_cache or os.environ.get("BATCHBENCH_HF_CACHE") or os.environ.get("HF_HOME")
        self.hf_cache = str(Path(cache or "~/.cache/huggingface").expanduser()) if mount_hf_cache else None
        self.publish_ip = publish_ip
        self.url_host = url_host or ("127.0.0.1" if publish_ip in ("0.0.0.0", "") else publish_ip)
        self.stop_timeout = stop_timeout
        self.pull = pull
        self.cpus = cpus
        self.model_dir = str(Path(model_dir).expanduser().resolve()) if model_dir is not None else None
        self.registry = registry if registry is not None else REGISTRY
        self._client = client
        self._own_client = client is None
        self.name = f"batchbench-{engine}-{self.run_id}-{uuid.uuid4().hex[:6]}"
        self.container_id: str | None = None
        self.command: list[str] | None = None
        self.url: str | None = None
        self.host_port: int | None = None
        self.image_id: str | None = None
        self.image_digests: list[str] = []
        self.pulled: bool | None = None
        self.pull_s: float | None = None
        self.exit_code: int | None = None
        self.last_logs: str | None = None
        #: Read back once the container runs: the cpuset the daemon applied ("" = any CPU), and the container's
        #: main process where it is one of this machine's (its affinity is the kernel's view of that cpuset).
        self.applied_cpuset: str | None = None
        self._pid: int | None = None
        #: Files put into the container before it starts: path as the server sees it
        #: (relative to the image's working directory) → content.
        self.files: dict[str, str] = {}
        self._env: dict[str, str] = {}
        self._secrets: set[str] = set(token_env().values())
        self._status: str | None = None
        self._state: dict[str, Any] = {}
        self._checked_at = 0.0
        self._refreshing = threading.Lock()
        self._removed = False

    @classmethod
    def for_engine(cls, engine: str, *, images: str | os.PathLike[str] | None = None, cpu_build: bool = False,
                   image: str | None = None, **kwargs: Any) -> DockerLaunch:
        """The launch for ``engine`` as ``images.toml`` (or ``images``) pins it: ``image`` if given, else with
        ``cpu_build`` (a host without a GPU) the engine's ``cpu_image`` where it has one, else its ``image``."""
        specs = load_specs(images)
        if engine not in specs:
            raise ValueError(f"no container spec for engine {engine!r} in {images or specs_path()} "
                             f"(known: {', '.join(sorted(specs))})")
        spec = specs[engine]
        return cls(engine, spec, image=image or (spec.cpu_image if cpu_build else None), **kwargs)

    # ---- what the results may show

    def _redact(self, text: str) -> str:
        return redact(text, self._secrets)

    def process_group(self) -> int | None:
        """The container's main process leads its process group (runc starts it in a session of its own), so
        where that process is visible here its group is the engine's processes, told apart from other work as a
        local server's are; None where the daemon runs its containers out of this machine's sight."""
        return self._visible_pid()

    def log_file(self) -> Path | None:
        return None

    def placement(self) -> EngineCpus:
        """The container's CPUs read back: its main process's affinity where it runs on this machine, else the
        cpuset the daemon reported at start (none: any CPU); ``refused`` where they are not the CPUs asked for.
        Before a start, or once the container is gone, the CPUs asked for."""
        if self.container_id is None or self._removed or self.applied_cpuset is None:
            return EngineCpus("container", self.cpus)
        running_on = self._process_cpus()
        if running_on is None and self.applied_cpuset:
            running_on = parse_cpu_list(self.applied_cpuset)
        refused = None
        if self.cpus is not None and running_on != self.cpus:
            on = f"CPU {format_cpu_list(running_on)}" if running_on is not None else "any CPU"
            refused = f"the container runs on {on}, not on CPU {format_cpu_list(self.cpus)} as placed"
        return EngineCpus("container", running_on, refused)

    def _process_cpus(self) -> frozenset[int] | None:
        """The affinity of the container's main process, where it is visible here."""
        pid = self._visible_pid()
        try:
            return frozenset(os.sched_getaffinity(pid)) if pid is not None else None
        except OSError:  # it exited meanwhile
            return None

    def _visible_pid(self) -> int | None:
        """The container's main process as this machine sees it: the pid the daemon reported, when that process's
        cgroup names the container (a daemon in another PID namespace, or on another machine, reports a pid that
        is not that process here)."""
        if self._pid is None or self.container_id is None or self._removed or not hasattr(os, "sched_getaffinity"):
            return None
        try:
            return self._pid if self.container_id in Path(f"/proc/{self._pid}/cgroup").read_text() else None
        except OSError:  # it exited, or there is no such process here
            return None

    def describe(self) -> dict[str, Any]:
        """Image, container and configuration, for the results; never a secret."""
        return {
            "launcher": "docker",
            "engine": self.engine,
            "image": self.spec.image,
            "image_id": self.image_id,
            "image_digests": list(self.image_digests),
            "pulled": self.pulled,
            "pull_s": self.pull_s,
            "docker_host": self._docker_host(),
            "container": self.name,
            "container_id": self.container_id,
            "run_id": self.run_id,
            "command": [self._redact(a) for a in self.command] if self.command is not None else None,
            "env": redact_env(self._env),
            "gpus": "all" if self.gpus is None else list(self.gpus),
            "shm_size": self.spec.shm_size if self.spec.ipc_mode != "host" else None,
            "ipc_mode": self.spec.ipc_mode,
            "ulimits": dict(self.spec.ulimits),
            "cpuset_cpus": format_cpu_list(self.cpus) if self.cpus is not None else None,
            "applied_cpuset": self.applied_cpuset,
            "model_mount": {"host": self.model_dir, "container": MODEL_MOUNT, "mode": "ro"} if self.model_dir else None,
            "hf_cache": {"host": self.hf_cache, "container": self.spec.hf_home} if self.hf_cache else None,
            "files": sorted(self.files),
            "url": self.url,
            "exit_code": self.exit_code,
        }

    def _docker_host(self) -> str:
        if self.base_url is None and self._client is not None and not self._own_client:
            return str(getattr(self._client.api, "base_url", docker_host()))
        return docker_host(self.base_url)

    def __repr__(self) -> str:
        return f"DockerLaunch(engine={self.engine!r}, image={self.spec.image!r}, container={self.name!r})"

    # ---- the docker calls (worker threads)

    def _ensure_client(self) -> docker.DockerClient:
        if self._client is None:
            self._client = connect(self.engine, self.base_url, self.api_version, self.timeout)
            self._own_client = True
        else:
            try:
                self._client.ping()
            except Exception as exc:
                where = self._docker_host()
                raise EngineCannotRunHere(self.engine, f"docker engine not reachable at {where}: {exc}") from exc
        return self._client

    def _ensure_image(self, client: docker.DockerClient) -> None:
        docker = _docker()
        image = self.spec.image
        try:
            found = client.images.get(image)
            self.pulled = False
        except docker.errors.ImageNotFound:
            missing = f"image {image} is not on the docker host ({self._docker_host()})"
            if not self.pull:
                raise ImagePullError(self.engine, f"{missing} and pull=False: {image_hint(image)}") from None
            if image.rsplit("/", 1)[-1].startswith(LOCAL_IMAGE_PREFIX):
                raise ImagePullError(self.engine, f"{missing}: {image_hint(image)}") from None
            found = self._pull(client, image)
            self.pulled = True
        except docker.errors.DockerException as exc:
            raise ImagePullError(self.engine, self._redact(f"cannot inspect image {image}: {exc}")) from exc
        self.image_id = found.attrs.get("Id") or found.id
        self.image_digests = list(found.attrs.get("RepoDigests") or [])

    def _pull(self, client: docker.DockerClient, image: str) -> Any:
        docker = _docker()
        repository, tag = docker.utils.parse_repository_tag(image)
        log.info("pulling %s (not on the docker host)", image)
        started = time.perf_counter()
        last_status = ""
        try:
            for message in client.api.pull(repository, tag=tag, stream=True, decode=True):
                if not isinstance(message, dict):
                    continue
                if message.get("error") or message.get("errorDetail"):
                    detail = message.get("error") or message["errorDetail"].get("message", message["errorDetail"])
                    why = f"pulling {image} failed: {detail}; {image_hint(image)}"
                    raise ImagePullError(self.engine, self._redact(why))
                last_status = str(message.get("status") or last_status)
            found = client.images.get(image)
        except ImagePullError:
            raise
        except docker.errors.DockerException as exc:
            why = f"pulling {image} failed: {exc}; {image_hint(image)}"
            raise ImagePullError(self.engine, self._redact(why)) from exc
        except Exception as exc:
            why = f"pulling {image} failed: {type(exc).__name__}: {exc}; {image_hint(image)}"
            raise ImagePullError(self.engine, self._redact(why)) from exc
        self.pull_s = time.perf_counter() - started
        log.info("pulled %s in %.0fs (%s)", image, self.pull_s, last_status)
        return found

    def _create_kwargs(self) -> dict[str, Any]:
        docker = _docker()
        spec = self.spec
        kwargs: dict[str, Any] = {
            "name": self.name,
            "command": self.command,
            "environment": dict(self._env),
            "labels": {LABEL_RUN: self.run_id, LABEL_ENGINE: self.engine},
            "ports": {spec.port_key: (self.publish_ip, None)},
            "detach": True,
        }
        if self.gpus is None:
            kwargs["device_requests"] = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
        elif self.gpus:
            kwargs["device_requests"] = [docker.types.DeviceRequest(device_ids=list(self.gpus), capabilities=[["gpu"]])]
        if spec.ipc_mode:
            kwargs["ipc_mode"] = spec.ipc_mode
        if spec.shm_size and spec.ipc_mode != "host":
            kwargs["shm_size"] = spec.shm_size
        if spec.ulimits:
            kwargs["ulimits"] = [docker.types.Ulimit(name=k, soft=v, hard=v) for k, v in spec.ulimits.items()]
        volumes = {}
        if self.hf_cache:
            volumes[self.hf_cache] = {"bind": spec.hf_home, "mode": "rw"}
        if self.model_dir:
            volumes[self.model_dir] = {"bind": MODEL_MOUNT, "mode": "ro"}
        if volumes:
            kwargs["volumes"] = volumes
        if self.cpus is not None:
            kwargs["cpuset_cpus"] = format_cpu_list(self.cpus)  # HostConfig.CpusetCpus
        return kwargs

    def _start_sync(self, argv: list[str], env: dict[str, str]) -> str:
        docker = _docker()
        client = self._ensure_client()
        self._ensure_image(client)
        self.command = list(self.spec.program) + list(argv)
        tokens = token_env()
        self._secrets |= set(tokens.values()) | {v for k, v in env.items() if is_secret_name(k)}
        self._env = {**self.spec.env, **env, **tokens}
        if self.hf_cache:
            self._env.setdefault("HF_HOME", self.spec.hf_home)
            if str(getattr(client.api, "base_url", "")).startswith("http+docker://localhost"):
                # A daemon on this machine's socket would create a missing bind source owned by root.
                Path(self.hf_cache).mkdir(parents=True, exist_ok=True)
        try:
            container = client.containers.create(self.spec.image, **self._create_kwargs())
        except docker.errors.DockerException as exc:
            raise EngineDied(self.engine, self._redact(f"cannot create container {self.name}: {exc}")) from exc
        self.container_id = container.id
        self.registry.register(container.id, functools.partial(_force_remove, client, container.id), self.name)
        if self.files:
            self._put_files(container)
        try:
            container.start()
        except docker.errors.DockerException as exc:
            hint = ""
            if "gpu" in str(exc).lower() and ("capabilities" in str(exc) or "device driver" in str(exc)):
                hint = " (is the NVIDIA Container Toolkit installed and configured for docker?)"
            elif "rlimit" in str(exc) and self.spec.ulimits:
                limits = ", ".join(f"{k}={v}" for k, v in self.spec.ulimits.items())
                hint = (f" (the daemon may not grant the ulimits {limits}: a container gets at most the daemon's own "
                        "hard limits; raise them where dockerd is started, e.g. LimitMEMLOCK=infinity in its unit)")
            self._capture_and_remove(container)
            raise EngineDied(self.engine, self._redact(f"cannot start container {self.name}: {exc}{hint}")) from exc
        self.host_port = self._published_port(container)
        self.url = f"http://{self.url_host}:{self.host_port}"
        log.info("started %s (%s) at %s", self.name, self.spec.image, self.url)
        return self.url

    def _put_files(self, container: Any) -> None:
        """Copy :attr:`files` into the created container (one tar, extracted at /)."""
        docker = _docker()
        workdir = (container.attrs.get("Config") or {}).get("WorkingDir") or "/"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for path, content in sorted(self.files.items()):
                data = content.encode()
                info = tarfile.TarInfo(posixpath.normpath(posixpath.join(workdir, path)).lstrip("/"))
                info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
                tar.addfile(info, io.BytesIO(data))
        try:
            container.put_archive("/", buf.getvalue())
        except docker.errors.DockerException as exc:
            self._capture_and_remove(container)
            why = f"cannot copy {sorted(self.files)} into {self.name}: {exc}"
            raise EngineDied(self.engine, self._redact(why)) from exc

    def _published_port(self, container: Any) -> int:
        """The host port Docker picked for the engine's port; EngineDied if the container already exited."""
        deadline = time.monotonic() + 5.0
        while True:
            container.reload()
            self._note_state(container.attrs.get("State") or {})
            if self._status is not None:
                self._capture_and_remove(container)
                raise EngineDied(
                    self.engine,
                    f"{self._status} at start\n--- container log (tail) ---\n{self.last_logs or '(empty)'}",
                )
            self.applied_cpuset = (container.attrs.get("HostConfig") or {}).get("CpusetCpus") or ""
            self._pid = (container.attrs.get("State") or {}).get("Pid") or None
            bindings = ((container.attrs.get("NetworkSettings") or {}).get("Ports") or {}).get(self.spec.port_key)
            for binding in bindings or ():
                if binding.get("HostPort") and binding.get("HostIp", "") in (self.publish_ip, "0.0.0.0", ""):
                    return int(binding["HostPort"])
            if bindings:
                return int(bindings[0]["HostPort"])
            if time.monotonic() > deadline:
                self._capture_and_remove(container)
                why = f"container {self.name} runs but publishes no port for {self.spec.port_key}"
                raise EngineDied(self.engine, why)
            time.sleep(0.1)

    def _note_state(self, state: Mapping[str, Any]) -> None:
        self._state = dict(state)
        self._checked_at = time.monotonic()
        status = state.get("Status")
        if status in ("exited", "dead"):
            self.exit_code = state.get("ExitCode")
            why = f"container {self.name} exited with code {self.exit_code}"
            if state.get("OOMKilled"):
                why += " (OOM killed)"
            if state.get("Error"):
                why += f": {self._redact(str(state['Error']))}"
            self._status = why
        elif status == "removing":
            self._status = f"container {self.name} is being removed"
        else:
            self._status = None

    def _refresh_sync(self) -> None:
        docker = _docker()
        try:
            if self._client is None or self.container_id is None:
                return
            try:
                attrs = self._client.api.inspect_container(self.container_id)
            except docker.errors.NotFound:
                self._status = f"container {self.name} no longer exists"
                self._checked_at = time.monotonic()
                return
            except Exception:
                return
            self._note_state(attrs.get("State") or {})
        finally:
            if self._refreshing.locked():
                self._refreshing.release()

    def _logs_sync(self, tail: int) -> str:
        if self._client is None or self.container_id is None:
            raise LookupError("no container")
        raw = self._client.api.logs(self.container_id, stdout=True, stderr=True, tail=tail)
        return self._redact(raw.decode("utf-8", "replace")).rstrip("\n")

    def _capture_and_remove(self, container: Any = None) -> None:
        """Keep the log tail, then remove the container (the failure paths of start())."""
        try:
            self.last_logs = self._logs_sync(200)
        except Exception as exc:
            self.last_logs = self.last_logs or f"(logs unavailable: {self._redact(str(exc))})"
        self._remove_sync(stop_first=False)

    def _remove_sync(self, *, stop_first: bool) -> None:
        docker = _docker()
        if self._removed or self._client is None or self.container_id is None:
            return
        api = self._client.api
        if stop_first:
            try:
                api.stop(self.container_id, timeout=self.stop_timeout)
            except docker.errors.NotFound:
                pass
            except docker.errors.DockerException as exc:
                log.warning("stopping %s failed (%s); removing it by force", self.name, self._redact(str(exc)))
            except Exception as exc:
                log.warning("stopping %s failed (%s); removing it by force", self.name, self._redact(str(exc)))
        try:
            api.remove_container(self.container_id, force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if exc.status_code != 409 or "already in progress" not in str(exc):
                raise
        self._removed = True
        self.registry.discard(self.container_id)
        if self._status is None:
            self._status = f"container {self.name} was stopped and removed"

    def _stop_sync(self) -> None:
        if self._removed or self.container_id is None:
            return
        if self._client is not None:
            try:
                attrs = self._client.api.inspect_container(self.container_id)
                self._note_state(attrs.get("State") or {})
                self.last_logs = self._logs_sync(200)
            except Exception as exc:
                log.debug("no final state/logs for %s: %s", self.name, self._redact(str(exc)))
        self._remove_sync(stop_first=True)

    # ---- the Launch protocol

    async def start(
        self, argv_for: Callable[[str, int], list[str]], env: dict[str, str], files: Mapping[str, str] | None = None
    ) -> str:
        """The Launch protocol's start; ``files`` (path → content) are added to :attr:`files`."""
        if files:
            self.files.update(files)
        if self.container_id is not None and not self._removed:
            raise RuntimeError(f"{self!r} is already started")
        if self.container_id is not None:  # started before: a fresh name, never a clash with the old one
            self.name = f"batchbench-{self.engine}-{self.run_id}-{uuid.uuid4().hex[:6]}"
        self.container_id, self._removed, self._status, self.exit_code = None, False, None, None
        self.last_logs, self.applied_cpuset, self._pid = None, None, None
        self.registry.install()
        argv = argv_for("0.0.0.0", self.spec.port)
        try:
            return await asyncio.to_thread(self._start_sync, argv, env)
        except BaseException:
            # Never leave a half-started container behind (start raised, so nobody calls stop()).
            if self.container_id is not None and not self._removed:
                await asyncio.to_thread(self._capture_and_remove)
            self._close_client()
            raise

    def dead(self) -> str | None:
        """Why the container is gone, or None while it runs.

        Answers from the last known state at once; when that is older than
        :attr:`refresh_interval`, a worker thread asks the daemon for the next call.
        """
        if self.container_id is None:
            return "never started" if self._status is None else self._status
        if self._removed or self._status is not None:
            return self._status
        if time.monotonic() - self._checked_at >= self.refresh_interval and self._refreshing.acquire(blocking=False):
            threading.Thread(target=self._refresh_sync, name=f"dead-{self.name}", daemon=True).start()
        return self._status

    async def refresh(self) -> str | None:
        """Ask the daemon now; return what :meth:`dead` then says."""
        if self.container_id is not None and not self._removed:
            await asyncio.to_thread(self._refreshing.acquire)
            await asyncio.to_thread(self._refresh_sync)
        return self.dead()

    async def logs(self, tail: int = 50) -> str:
        if self.container_id is not None and not self._removed:
            try:
                self.last_logs = await asyncio.to_thread(self._logs_sync, max(tail, 1))
                return self.last_logs
            except Exception as exc:
                if self.last_logs is None:
                    return f"(logs unavailable: {self._redact(str(exc))})"
        if self.last_logs is None:
            return "(no container log)"
        return "\n".join(self.last_logs.splitlines()[-tail:])

    async def stop(self) -> None:
        try:
            await asyncio.to_thread(self._stop_sync)
        finally:
            if self._removed or self.container_id is None:
                self._close_client()

    def _close_client(self) -> None:
        if self._own_client and self._client is not None:
            try:
                self._client.close()
            except Exception as exc:  # pragma: no cover
                log.debug("closing the docker client: %s", exc)
            self._client = None
