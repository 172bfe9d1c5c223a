"""``--image ENGINE=REF``: the image an engine's container runs instead of images.toml's pin, checked before anything
starts (bench, capacity and the pytest plugin take it; each mistake is one line and exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchbench.adapters import registry
from batchbench.adapters.launch.docker import DockerLaunch
from batchbench.cli import main
from batchbench.core.exits import EXIT_USAGE
from batchbench.options import engine_options
from batchbench.workload.profiles import get_profile


@pytest.mark.parametrize(("argv", "message"), [
    (["--image", "vllm"], "--image 'vllm': write ENGINE=IMAGE:TAG"),
    (["--image", "tgi=ghcr.io/huggingface/text-generation-inference:3.3.6", "--launch", "docker"],
     "engine 'tgi' is not selected (add --engine tgi)"),
    (["--image", "vllm=batchbench-vllm-cpu", "--launch", "docker"], "must carry an explicit tag"),
    (["--image", "vllm=my/vllm:latest", "--launch", "docker"], "pin a version, not 'latest'"),
    (["--image", "vllm=my/vllm:1", "--engine-url", "vllm=http://127.0.0.1:9"], "reached at a URL"),
    (["--image", "vllm=my/vllm:1", "--launch", "local"], "runs as a local process here (--launch local); add "
                                                          "--launch docker"),
    (["--image", "vllm=my/vllm:1", "--image", "vllm=my/vllm:2", "--launch", "docker"], "already runs my/vllm:1"),
])
@pytest.mark.parametrize("command", ["bench", "capacity"])
def test_a_wrong_image_is_a_usage_error_before_anything_starts(
        command: str, argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    extra = ["--slo", "ttft_p99=1s"] if command == "capacity" else []
    assert main([command, "--engine", "vllm", *argv, *extra, "--results-dir", str(tmp_path)]) == EXIT_USAGE
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no run folder, no engine


def test_auto_launch_on_a_host_without_a_gpu_runs_vllm_locally_so_an_image_needs_launch_docker(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(registry, "_gpu_host", lambda: False)
    with pytest.raises(ValueError, match=r"runs as a local process here \(--launch auto\)"):
        engine_options(["vllm"], engine_urls=[], model=None, launch="auto", profile=get_profile("quick"),
                       results_dir=tmp_path, images=["vllm=my/vllm:1"])
    engines, options = engine_options(["vllm"], engine_urls=[], model=None, launch="docker",
                                      profile=get_profile("quick"), results_dir=tmp_path, images=["vllm=my/vllm:1"])
    assert engines == ("vllm",) and options.image_for("vllm") == "my/vllm:1"
    launch = registry.make_engine("vllm", None, options).launch
    assert isinstance(launch, DockerLaunch) and launch.spec.image == "my/vllm:1"
    assert launch.spec.port == 8000 and launch.spec.shm_size == "16g"  # the rest of images.toml's [vllm] is kept
