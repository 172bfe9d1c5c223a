"""llama.cpp's C++ server (``llama-server``), built once per version from the source in llama-cpp-python's sdist.

No registry here serves a ``llama-server`` binary, but PyPI serves llama-cpp-python's sdist, whose
``vendor/llama.cpp/`` is llama.cpp's complete source at a pinned commit: the server, the HF-to-GGUF converter
and gguf-py. :func:`ensure_server` downloads that sdist (pip, so the user's index and proxy settings apply),
checks its SHA-256, configures and builds only the server target, and keeps the binary in
``CACHE/llama.cpp/VERSION-VARIANT/`` (``$BATCHBENCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/batchbench``, else
``~/.cache/batchbench``): a later call, or a later checkout, finds it there and builds nothing. A new
:data:`VERSION` is a new folder. The converter's files are kept beside the binary for
:mod:`batchbench.adapters.launch.gguf`.

Build flags (checked against llama.cpp 0c1e57098's CMakeLists.txt, ggml/CMakeLists.txt and
vendor/cpp-httplib/CMakeLists.txt): ``GGML_NATIVE=OFF`` so a binary built on one machine runs on another of
the same architecture (on x86-64 ggml then turns on its baseline: SSE4.2, AVX, AVX2, FMA, F16C, BMI2, so a
Haswell or later CPU; no AVX-512), static libraries linked into the one binary, no OpenSSL (the server's
downloads and TLS are not used), no web UI (``LLAMA_USE_PREBUILT_UI`` defaults on and would download it from
the Hugging Face hub during the build), no tests, examples or the unified app. The binary needs only libc,
libstdc++, libgcc_s and libgomp. With ``cuda_archs`` the same build adds ``GGML_CUDA=ON`` and
``CMAKE_CUDA_ARCHITECTURES`` (a GPU host with the CUDA toolkit, cuBLAS included).

A machine that reaches no package index (a lent GPU host) builds from a packed source instead of the sdist:
``python -m batchbench.adapters.launch.llamacpp_build pack DIR`` writes the tree the build reads (8 MB, its origin
in a ``BATCHBENCH_SOURCE`` file inside), and :data:`SOURCE_ENV` names it there. :data:`CUDA_ENV` makes the
``llamacpp`` engine run the CUDA build of those architectures as its local process (``docker/device-check.sh
--llamacpp-cuda``).

Building by hand rather than through llama-cpp-python's own ``pip install``: that builds the Python binding's
shared library, not the server, and its own Python server serves one request at a time.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

#: The sdist whose ``vendor/llama.cpp`` is built, pinned by version and SHA-256 (from PyPI's simple index).
SDIST = "llama-cpp-python"
VERSION = "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
#: The llama.cpp commit that sdist vendors (its CHANGELOG: "update llama.cpp to ggml-org/llama.cpp@0c1e57098"),
#: written into the binary's version (its shallow clone has no build number).
LLAMA_CPP_COMMIT = "0c1e57098"
#: Where the sdist keeps llama.cpp.
VENDORED = "vendor/llama.cpp/"
#: Folders of the vendored tree the build and the converter never read (110 of its 176 MB: the docs, the vocab
#: test models, the tests and examples, the web app's sources), left out when it is unpacked.
_UNUSED = ("docs/", "models/", "tests/", "examples/", "benches/", "media/", "pocs/", "tools/ui/src/",
           "tools/ui/static/", "tools/ui/tests/", ".devops/", ".github/")

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    f"-DLLAMA_BUILD_COMMIT={LLAMA_CPP_COMMIT}", "-DLLAMA_BUILD_NUMBER=0",
)
#: What a build needs on PATH, and the Debian packages that give it.
_TOOLS = {"cmake": "cmake", "c++": "g++", "make": "make"}
#: A packed source (:func:`pack_source`) to build from instead of downloading the sdist.
SOURCE_ENV = "BATCHBENCH_LLAMACPP_SOURCE"
#: CUDA architectures (e.g. ``90``) whose build the ``llamacpp`` engine runs as its local process.
CUDA_ENV = "BATCHBENCH_LLAMACPP_CUDA_ARCHS"
#: What a packed source says of where it came from (checked before a build from it).
_ORIGIN = "BATCHBENCH_SOURCE"
#: The converter's parts, kept beside the binary (:mod:`batchbench.adapters.launch.gguf`).
CONVERTER = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

Say = Callable[[str], None]


class BuildError(RuntimeError):
    """The server could not be built here; the message is one line saying why and what to do."""


def to_stderr(line: str) -> None:
    """A progress line, where a one-time build says what it is doing."""
    print(line, file=sys.stderr, flush=True)


def cache_root() -> Path:
    """batchbench's cache folder: ``$BATCHBENCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/batchbench``, else
    ``~/.cache/batchbench``."""
    if os.environ.get("BATCHBENCH_CACHE_DIR"):
        return Path(os.environ["BATCHBENCH_CACHE_DIR"])
    base = Path(os.environ["XDG_CACHE_HOME"]) if os.environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "batchbench"


def variant(cuda_archs: str | None = None) -> str:
    """``cpu``, or ``cuda90`` for a CUDA build for those architectures."""
    return "cpu" if not cuda_archs else "cuda" + re.sub(r"[^0-9a-z]+", "-", cuda_archs.lower())


def build_dir(cuda_archs: str | None = None) -> Path:
    return cache_root() / "llama.cpp" / f"{VERSION}-{variant(cuda_archs)}"


def server_path(cuda_archs: str | None = None) -> Path:
    """Where the built server is (or will be)."""
    return build_dir(cuda_archs) / "llama-server"


def converter_dir() -> Path:
    """Where the sdist's HF-to-GGUF converter is kept (beside the CPU build)."""
    return build_dir() / "convert"


def built(cuda_archs: str | None = None) -> dict[str, object] | None:
    """What the cached build says of itself (``build.json``: version, SHA-256, flags, seconds), or None when there
    is no complete build."""
    info = build_dir(cuda_archs) / "build.json"
    try:
        found = json.loads(info.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not server_path(cuda_archs).is_file() or not isinstance(found, dict):
        return None
    return found


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold the folder's build lock: two processes that both find no build build it once."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def missing_tools() -> list[str]:
    """The Debian packages to install for what a build needs and PATH lacks."""
    return [package for tool, package in _TOOLS.items() if shutil.which(tool) is None]


def ensure_server(*, cuda_archs: str | None = None, say: Say = to_stderr, jobs: int | None = None) -> Path:
    """The built server, building it first where the cache has none (minutes: it says so, with its progress).

    Raises :class:`BuildError` with one line: a missing compiler or cmake (naming the packages), a download
    that failed or whose SHA-256 differs, a build that failed (with the log's path)."""
    if built(cuda_archs) is not None:
        return server_path(cuda_archs)
    folder = build_dir(cuda_archs)
    with _locked(folder):
        if built(cuda_archs) is not None:
            return server_path(cuda_archs)
        if missing := missing_tools():
            raise BuildError(f"building llama.cpp's server needs {', '.join(missing)}: "
                             f"apt-get install {' '.join(missing)} (or your system's packages for them)")
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="build-", dir=folder) as tmp:
            work = Path(tmp)
            source = _source(work / "src", say)
            jobs = jobs or os.cpu_count() or 1
            say(f"batchbench: building llama.cpp {LLAMA_CPP_COMMIT}'s server from {SDIST} {VERSION} "
                f"({variant(cuda_archs)}, {jobs} jobs; once per version, several minutes on 2 CPUs)")
            flags = [*CMAKE_FLAGS, *(_cuda_flags(cuda_archs) if cuda_archs else [])]
            log = folder / "build.log"
            _run(["cmake", "-S", str(source), "-B", str(work / "build"), *flags], log, say, "configure")
            _run(["cmake", "--build", str(work / "build"), "--target", "llama-server", "-j", str(jobs)], log, say,
                 "build")
            binary = work / "build" / "bin" / "llama-server"
            shutil.copy2(binary, folder / "llama-server.tmp")
            os.replace(folder / "llama-server.tmp", server_path(cuda_archs))
            if not (converter_dir() / "convert_hf_to_gguf.py").is_file():
                _keep_converter(source, converter_dir())
        seconds = time.monotonic() - started
        (folder / "build.json").write_text(json.dumps({
            "sdist": SDIST, "version": VERSION, "sha256": SHA256, "llama_cpp_commit": LLAMA_CPP_COMMIT,
            "flags": flags, "jobs": jobs, "seconds": round(seconds, 1)}, indent=1), encoding="utf-8")
        say(f"batchbench: llama.cpp's server built in {seconds / 60:.1f} min: {server_path(cuda_archs)}")
        return server_path(cuda_archs)


def cuda_archs_from_env() -> str | None:
    """The CUDA architectures :data:`CUDA_ENV` names, or None: the CPU build."""
    return os.environ.get(CUDA_ENV) or None


def _cuda_flags(archs: str) -> list[str]:
    """One GPU's architectures only, and no FlashAttention kernels: their template instances are most of the CUDA
    compile (a short run on a lent GPU must build in minutes); llama.cpp then attends without them."""
    return ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={archs}", "-DGGML_CUDA_NCCL=OFF", "-DGGML_CUDA_FA=OFF"]


def _source(into: Path, say: Say) -> Path:
    """llama.cpp's source unpacked into ``into``: from the packed source :data:`SOURCE_ENV` names, else from the
    sdist (downloaded and checked)."""
    packed = os.environ.get(SOURCE_ENV)
    if not packed:
        return unpack(fetch_sdist(into.parent, say), into)
    into.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(packed) as tar:
            tar.extractall(into, filter="data")
    except (OSError, tarfile.TarError) as exc:
        raise BuildError(f"{SOURCE_ENV}={packed}: cannot unpack it: {exc}") from exc
    origin = (into / _ORIGIN).read_text(encoding="utf-8") if (into / _ORIGIN).is_file() else ""
    if f"{SDIST} {VERSION} {SHA256}" not in origin:
        raise BuildError(f"{SOURCE_ENV}={packed} is not llama.cpp's source from {SDIST} {VERSION} "
                         f"(make one: python -m batchbench.adapters.launch.llamacpp_build pack DIR)")
    say(f"batchbench: llama.cpp's source from {packed}")
    return into


def pack_source(out_dir: Path, say: Say = to_stderr) -> Path:
    """The tree a build reads (the sdist's ``vendor/llama.cpp`` without what no build reads), as one ``.tar.gz`` in
    ``out_dir``, for a machine without a package index; its origin is written inside."""
    out = out_dir / f"llama.cpp-{LLAMA_CPP_COMMIT}-src.tar.gz"
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pack-") as tmp:
        source = unpack(fetch_sdist(Path(tmp), say), Path(tmp) / "src")
        (source / _ORIGIN).write_text(f"{SDIST} {VERSION} {SHA256} vendor/llama.cpp {LLAMA_CPP_COMMIT}\n",
                                      encoding="utf-8")
        with tarfile.open(out.with_suffix(".tmp"), "w:gz") as tar:
            tar.add(source, arcname=".")
        os.replace(out.with_suffix(".tmp"), out)
    return out


def fetch_sdist(into: Path, say: Say = to_stderr) -> Path:
    """The pinned sdist, downloaded by pip (the user's index, proxy and certificates apply) into ``into`` and
    checked against :data:`SHA256`."""
    say(f"batchbench: downloading {SDIST} {VERSION} (the sdist, ~77 MB) for llama.cpp's source")
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "-d", str(into), f"{SDIST}=={VERSION}"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = sorted(into.glob("llama_cpp_python-*.tar.gz"))
    if done.returncode != 0 or not found:
        last = (done.stderr.strip().splitlines() or ["no sdist downloaded"])[-1]
        raise BuildError(f"cannot download {SDIST}=={VERSION} with pip: {last}")
    digest = hashlib.sha256(found[0].read_bytes()).hexdigest()
    if digest != SHA256:
        raise BuildError(f"{found[0].name} has SHA-256 {digest}, not the pinned {SHA256}: not building it")
    return found[0]


def unpack(sdist: Path, into: Path) -> Path:
    """The sdist's ``vendor/llama.cpp`` unpacked into ``into`` (without what no build reads); its root."""
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            _, _, inside = member.name.partition("/")
            if not inside.startswith(VENDORED):
                continue
            rel = inside[len(VENDORED):]
            if not rel or rel.startswith(_UNUSED) or not (member.isfile() or member.isdir()):
                continue
            member.name = rel
            members.append(member)
        tar.extractall(into, members=members, filter="data")
    return into


def _keep_converter(source: Path, dest: Path) -> None:
    """Copy the HF-to-GGUF converter's parts out of a build's source tree into the cache."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for part in CONVERTER:
        src = source / part.rstrip("/")
        if src.is_dir():
            shutil.copytree(src, tmp / src.name, ignore=shutil.ignore_patterns("tests", "__pycache__"))
        else:
            shutil.copy2(src, tmp / src.name)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)


#: cmake --build's progress: ``[ 45%] Building CXX object ...``.
_PROGRESS = re.compile(rb"^\[\s*(\d+)%\]")


def _run(cmd: list[str], log: Path, say: Say, what: str) -> None:
    """Run one build step, its output appended to ``log``; say the build's progress every tenth."""
    shown = -10
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                out.write(line)
                m = _PROGRESS.match(line)
                if m is not None and int(m.group(1)) >= shown + 10:
                    shown = int(m.group(1)) // 10 * 10
                    say(f"batchbench: llama.cpp {what}: {shown}%")
        except BaseException:
            proc.kill()
            raise
        finally:
            proc.wait()
    if proc.returncode != 0:
        raise BuildError(f"llama.cpp's {what} failed (exit {proc.returncode}); its output is in {log}")



def main(argv: list[str] | None = None) -> int:
    """``python -m batchbench.adapters.launch.llamacpp_build pack DIR | build [--cuda-archs A]``: pack the source for
    a machine without an index, or build (once) the CPU or CUDA server; one line and exit 1 where it cannot."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m batchbench.adapters.launch.llamacpp_build")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("pack", help="write llama.cpp's source as one .tar.gz").add_argument("dir", type=Path)
    build = commands.add_parser("build", help="build the server (cached by version and variant)")
    build.add_argument("--cuda-archs", help="a CUDA build for these architectures, e.g. 90")
    args = parser.parse_args(argv)
    try:
        path = pack_source(args.dir) if args.command == "pack" else ensure_server(cuda_archs=args.cuda_archs)
    except BuildError as exc:
        print(f"batchbench: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
