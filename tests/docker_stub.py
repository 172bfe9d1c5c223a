"""A local stand-in for the Docker Engine API, for testing batchbench.adapters.launch.docker without a daemon.

It serves, over HTTP on 127.0.0.1, the endpoints the docker SDK calls for
batchbench's flow, and records every call (method, path without the API
version prefix, query, JSON body) so tests can check the exact requests:

    GET  /_ping, /version
    GET  /images/{name}/json                  inspect (404 "No such image")
    POST /images/create?fromImage=&tag=       pull: a chunked stream of JSON messages
    POST /containers/create?name=             body: Config + HostConfig
    PUT  /containers/{id}/archive?path=       a tar, extracted into the container's file table
    POST /containers/{id}/start|stop|wait
    GET  /containers/{id}/json                inspect
    GET  /containers/{id}/logs                multiplexed stream (8-byte frame headers)
    DELETE /containers/{id}?force=
    GET  /containers/json?all=&filters=       label filters

Behaviour is set with attributes: ``images`` present, ``pull_error`` /
``pull_status``, ``start_exit_code`` (the container exits as soon as it
starts), ``start_error``, ``host_port`` (what published ports map to: point it
at a real local server to make the "engine" answer), ``log_lines``.
"""

from __future__ import annotations

import contextlib
import io
import json
import posixpath
import re
import struct
import tarfile
import threading
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import parse_qs, unquote, urlsplit

API_VERSION = "1.43"


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, Any]
    body: Any


def _truthy(value: Any) -> bool:
    return str(value).lower() in ("1", "true", "yes")


class DockerStub:
    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.images: dict[str, dict[str, Any]] = {}
        self.containers: dict[str, dict[str, Any]] = {}
        self.pull_error: str | None = None
        self.pull_status: tuple[int, str] | None = None
        self.start_error: str | None = None
        self.start_exit_code: int | None = None
        self.host_port: int | None = None
        self.working_dir = "/app"
        self.log_lines: list[tuple[int, str]] = [(1, "INFO starting server"), (2, "WARNING stderr line")]
        self._next_port = 49153
        self._lock = threading.Lock()
        stub = self

        class Handler(_Handler):
            owner = stub

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, name="docker-stub", daemon=True
        )

    # ---- lifecycle

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def base_url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self) -> Self:
        self._thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers for tests

    def add_image(self, name: str) -> None:
        self.images[name] = {
            "Id": "sha256:" + uuid.uuid5(uuid.NAMESPACE_URL, name).hex * 2,
            "RepoTags": [name],
            "RepoDigests": [name.rsplit(":", 1)[0] + "@sha256:" + "ab" * 32],
        }

    def add_container(self, name: str, labels: dict[str, str], *, running: bool = True) -> str:
        cid = uuid.uuid4().hex + uuid.uuid4().hex
        self.containers[cid] = self._new_container(cid, name, {"Image": "busybox:1", "Labels": labels}, {})
        self.containers[cid]["State"].update(Status="running" if running else "exited", Running=running)
        return cid

    def exit_container(self, cid: str, code: int, lines: list[str] = ()) -> None:
        """Make a running container exit, as a crashing server would."""
        container = self.containers[cid]
        container["logs"].extend((2, line) for line in lines)
        container["State"].update(Status="exited", Running=False, ExitCode=code)

    def calls_to(self, method: str, pattern: str) -> list[Call]:
        return [c for c in self.calls if c.method == method and re.fullmatch(pattern, c.path)]

    def sequence(self) -> list[str]:
        """The calls as "METHOD /path" with container ids replaced by {id}."""
        out = []
        for c in self.calls:
            path = re.sub(r"/containers/[0-9a-f]{64}", "/containers/{id}", c.path)
            out.append(f"{c.method} {path}")
        return out

    # ---- state

    def _new_container(self, cid: str, name: str, body: dict[str, Any], host_config: dict[str, Any]) -> dict[str, Any]:
        config = {k: v for k, v in body.items() if k != "HostConfig"}
        config.setdefault("Tty", False)
        config.setdefault("WorkingDir", self.working_dir)  # the image's WORKDIR
        config.setdefault("Labels", {})
        return {
            "Id": cid,
            "Name": "/" + name,
            "Image": self.images.get(body.get("Image", ""), {}).get("Id", "sha256:" + "0" * 64),
            "Config": config,
            "HostConfig": host_config,
            "State": {"Status": "created", "Running": False, "ExitCode": 0, "OOMKilled": False, "Error": ""},
            "NetworkSettings": {"Ports": {}},
            "logs": list(self.log_lines),
            "files": {},
        }

    def _inspect(self, container: dict[str, Any]) -> dict[str, Any]:
        doc = {k: v for k, v in container.items() if k not in ("logs", "files")}
        if not container["State"]["Running"]:
            doc = {**doc, "NetworkSettings": {"Ports": {}}}
        return doc


class _Handler(BaseHTTPRequestHandler):
    owner: DockerStub
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as separate writes

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # ---- responses

    def _send(self, status: int, body: Any = None, *, content_type: str = "application/json") -> None:
        if body is None:
            data = b""
        elif isinstance(body, bytes):
            data = body
        elif isinstance(body, str):
            data = body.encode()
        else:
            data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Api-Version", API_VERSION)
        if status not in (204, 304):
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if status not in (204, 304):
            self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"message": message})

    def _stream(self, messages: list[dict[str, Any]]) -> None:
        self.send_response(200)
        self.send_header("Api-Version", API_VERSION)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for message in messages:
            chunk = (json.dumps(message) + "\r\n").encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.write(b"0\r\n\r\n")

    # ---- dispatch

    def _handle(self, method: str) -> None:
        url = urlsplit(self.path)
        path = re.sub(r"^/v\d+\.\d+", "", unquote(url.path))
        query = {k: v[0] if len(v) == 1 else v for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if path.endswith("/archive"):  # a tar (the SDK sends no Content-Type for it)
            body: Any = raw
        else:
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode(errors="replace")
        stub = self.owner
        with stub._lock:
            stub.calls.append(Call(method, path, query, body))
        with contextlib.suppress(BrokenPipeError):  # the client went away
            self._route(method, path, query, body)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def _route(self, method: str, path: str, query: dict[str, Any], body: Any) -> None:
        stub = self.owner
        if path == "/_ping":
            return self._send(200, "OK", content_type="text/plain")
        if path == "/version":
            return self._send(200, {"Version": "24.0.9", "ApiVersion": API_VERSION, "MinAPIVersion": "1.12"})
        if m := re.fullmatch(r"/images/(.+)/json", path):
            name = m.group(1)
            if name not in stub.images:
                return self._error(404, f"No such image: {name}")
            return self._send(200, stub.images[name])
        if path == "/images/create" and method == "POST":
            return self._pull(query)
        if path == "/containers/create" and method == "POST":
            return self._create(query, body or {})
        if path == "/containers/json":
            return self._list(query)
        if m := re.fullmatch(r"/containers/([^/]+)(/\w+)?", path):
            cid, action = m.group(1), (m.group(2) or "")[1:]
            container = stub.containers.get(cid) or next(
                (c for c in stub.containers.values() if c["Name"] == "/" + cid), None
            )
            if container is None:
                return self._error(404, f"No such container: {cid}")
            return self._container(method, action, container, query, body)
        return self._error(404, "page not found")

    def _pull(self, query: dict[str, Any]) -> None:
        stub = self.owner
        repo, tag = query.get("fromImage", ""), query.get("tag") or "latest"
        if stub.pull_status is not None:
            status, message = stub.pull_status
            return self._error(status, message)
        messages: list[dict[str, Any]] = [
            {"status": f"Pulling from {repo}", "id": tag},
            {"status": "Downloading", "progressDetail": {"current": 1, "total": 2}, "id": "abc123"},
        ]
        if stub.pull_error is not None:
            messages.append({"errorDetail": {"message": stub.pull_error}, "error": stub.pull_error})
        else:
            stub.add_image(f"{repo}:{tag}")
            messages += [
                {"status": "Digest: sha256:" + "ab" * 32},
                {"status": f"Status: Downloaded newer image for {repo}:{tag}"},
            ]
        self._stream(messages)
        return None

    def _create(self, query: dict[str, Any], body: dict[str, Any]) -> None:
        stub = self.owner
        image = body.get("Image", "")
        if image not in stub.images:
            return self._error(404, f"No such image: {image}")
        name = query.get("name") or uuid.uuid4().hex[:12]
        if any(c["Name"] == "/" + name for c in stub.containers.values()):
            return self._error(409, f'Conflict. The container name "/{name}" is already in use')
        cid = uuid.uuid4().hex + uuid.uuid4().hex
        stub.containers[cid] = stub._new_container(cid, name, body, body.get("HostConfig") or {})
        self._send(201, {"Id": cid, "Warnings": []})
        return None

    def _container(
        self, method: str, action: str, container: dict[str, Any], query: dict[str, Any], body: Any
    ) -> None:
        stub = self.owner
        state = container["State"]
        if method == "GET" and action == "json":
            return self._send(200, stub._inspect(container))
        if method == "POST" and action == "start":
            if state["Running"]:
                return self._send(304)
            if stub.start_error is not None:
                return self._error(500, stub.start_error)
            if stub.start_exit_code is not None:
                state.update(Status="exited", Running=False, ExitCode=stub.start_exit_code)
                container["logs"].append((2, "ERROR: fatal error while loading the model"))
                return self._send(204)
            state.update(Status="running", Running=True)
            ports = {}
            for key, bindings in (container["HostConfig"].get("PortBindings") or {}).items():
                with stub._lock:
                    port = stub.host_port or stub._next_port
                    stub._next_port += 1
                ports[key] = [{"HostIp": (b.get("HostIp") or "0.0.0.0"), "HostPort": str(port)} for b in bindings]
            container["NetworkSettings"] = {"Ports": ports}
            return self._send(204)
        if method == "POST" and action == "stop":
            if not state["Running"]:
                return self._send(304)
            state.update(Status="exited", Running=False, ExitCode=0)
            return self._send(204)
        if method == "PUT" and action == "archive":
            # Extract the tar into the container's file table (path → bytes).
            base = query.get("path", "/")
            with tarfile.open(fileobj=io.BytesIO(body or b"")) as tar:
                for member in tar.getmembers():
                    if member.isfile():
                        data = tar.extractfile(member).read()
                        container["files"][posixpath.join(base, member.name)] = data
            return self._send(200)
        if method == "POST" and action == "wait":
            return self._send(200, {"StatusCode": state["ExitCode"], "Error": None})
        if method == "GET" and action == "logs":
            lines = container["logs"]
            tail = query.get("tail", "all")
            if tail != "all":
                lines = lines[-int(tail):] if int(tail) > 0 else []
            wanted = {1} if _truthy(query.get("stdout")) else set()
            wanted |= {2} if _truthy(query.get("stderr")) else set()
            frames = b""
            for stream, line in lines:
                if stream in wanted:
                    payload = (line + "\n").encode()
                    frames += struct.pack(">BxxxL", stream, len(payload)) + payload
            return self._send(200, frames, content_type="application/vnd.docker.multiplexed-stream")
        if method == "DELETE" and action == "":
            if state["Running"] and not _truthy(query.get("force")):
                return self._error(409, "You cannot remove a running container. Stop it or force remove")
            stub.containers.pop(container["Id"], None)
            return self._send(204)
        return self._error(404, "page not found")

    def _list(self, query: dict[str, Any]) -> None:
        stub = self.owner
        filters = json.loads(query.get("filters") or "{}")
        labels = filters.get("label", [])
        if isinstance(labels, dict):  # the older map form {"k=v": true}
            labels = [k for k, v in labels.items() if v]
        out = []
        for c in stub.containers.values():
            if not _truthy(query.get("all", "0")) and not c["State"]["Running"]:
                continue
            have = c["Config"].get("Labels") or {}
            ok = True
            for wanted in labels:
                key, eq, value = wanted.partition("=")
                if key not in have or (eq and have[key] != value):
                    ok = False
            if ok:
                out.append({
                    "Id": c["Id"], "Names": [c["Name"]], "Image": c["Config"].get("Image"),
                    "Labels": have, "State": c["State"]["Status"],
                })
        self._send(200, out)
