"""llama.cpp's build without building: missing tools, the packed source a GPU host builds from, the CUDA variant.

The real CPU build is exercised by ``bootstrap.sh`` and tests/test_llamacpp.py; here the parts around it, with a
stand-in sdist, so that a GPU host's first run (``docker/device-check.sh --llamacpp-cuda``) meets no surprise.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from batchbench.adapters.launch import llamacpp_build
from batchbench.adapters.launch.local import LocalProcess
from batchbench.adapters.llamacpp import LlamaCppEngine, _server_program
from batchbench.core.config import ModelRef


def _fake_sdist(folder: Path) -> Path:
    """An sdist shaped as llama-cpp-python's: the vendored tree, with a folder no build reads."""
    path = folder / f"llama_cpp_python-{llamacpp_build.VERSION}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in {"vendor/llama.cpp/CMakeLists.txt": "project(llama)\n",
                           "vendor/llama.cpp/ggml/src/ggml.c": "int x;\n",
                           "vendor/llama.cpp/docs/build.md": "docs\n",
                           "llama_cpp/__init__.py": "\n"}.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_python-{llamacpp_build.VERSION}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(llamacpp_build.SOURCE_ENV, raising=False)
    monkeypatch.delenv(llamacpp_build.CUDA_ENV, raising=False)
    return tmp_path / "cache"


def test_a_missing_compiler_is_one_line_naming_the_packages(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llamacpp_build.shutil, "which", lambda tool: None if tool in ("c++", "cmake") else "/x")
    with pytest.raises(llamacpp_build.BuildError) as caught:
        llamacpp_build.ensure_server()
    assert "apt-get install cmake g++" in str(caught.value) and "\n" not in str(caught.value)


def test_a_packed_source_unpacks_the_tree_a_build_reads(cache: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llamacpp_build, "fetch_sdist", lambda into, say: _fake_sdist(into))
    packed = llamacpp_build.pack_source(tmp_path / "packed", say=lambda line: None)
    assert packed.name == f"llama.cpp-{llamacpp_build.LLAMA_CPP_COMMIT}-src.tar.gz"
    # A machine without an index: no download is tried (fetch_sdist would fail the test).
    monkeypatch.setattr(llamacpp_build, "fetch_sdist", lambda into, say: pytest.fail("downloaded"))
    monkeypatch.setenv(llamacpp_build.SOURCE_ENV, str(packed))
    said: list[str] = []
    tree = llamacpp_build._source(tmp_path / "src", said.append)
    assert (tree / "CMakeLists.txt").is_file() and (tree / "ggml" / "src" / "ggml.c").is_file()
    assert not (tree / "docs").exists()
    assert said == [f"batchbench: llama.cpp's source from {packed}"]


def test_a_tarball_that_is_not_the_packed_source_is_refused(cache: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(llamacpp_build.SOURCE_ENV, str(_fake_sdist(tmp_path)))  # no origin inside
    with pytest.raises(llamacpp_build.BuildError, match="llamacpp_build pack DIR"):
        llamacpp_build._source(tmp_path / "src", lambda line: None)
    monkeypatch.setenv(llamacpp_build.SOURCE_ENV, str(tmp_path / "missing.tar.gz"))
    with pytest.raises(llamacpp_build.BuildError, match="cannot unpack"):
        llamacpp_build._source(tmp_path / "src2", lambda line: None)


def test_the_cuda_variant_is_its_own_build_for_one_architecture(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert llamacpp_build.server_path("90") != llamacpp_build.server_path()
    assert llamacpp_build.server_path("90").parent.name == f"{llamacpp_build.VERSION}-cuda90"
    flags = llamacpp_build._cuda_flags("90")
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in flags and "-DGGML_CUDA_FA=OFF" in flags
    assert _server_program() == (str(llamacpp_build.server_path()),)
    monkeypatch.setenv(llamacpp_build.CUDA_ENV, "90")
    assert _server_program() == (str(llamacpp_build.server_path("90")),)


@pytest.mark.parametrize(("cuda", "expected"), [(None, False), ("90", True)])
def test_the_cuda_build_puts_every_layer_on_the_gpu(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                    cuda: str | None, expected: bool) -> None:
    if cuda is not None:
        monkeypatch.setenv(llamacpp_build.CUDA_ENV, cuda)
    engine = LlamaCppEngine(model=ModelRef("/models/tiny.gguf", max_model_len=256),
                            launch=LocalProcess(list(_server_program())))
    args = engine.server_args(engine.batching, host="127.0.0.1", port=8080)
    assert args[args.index("-m") + 1] == "/models/tiny.gguf"
    assert ("-ngl" in args and args[args.index("-ngl") + 1] == "all") is expected
