"""Engine selection: command-line names and URLs to configured adapters, and the mistakes users make."""

from __future__ import annotations

import pytest

from adapters.base import BatchingConfig
from adapters.registry import EngineOptions, make_engine, parse_engine_urls
from adapters.vllm import VLLMEngine
from batchbench.launcher import DockerLaunch
from batchbench.local_launch import LocalProcess
from conftest import parse_batching


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


@pytest.mark.parametrize(("name", "options", "message"), [
    ("hf-static", EngineOptions(urls=(("hf-static", "http://h:1"),)), "no URL mode"),
    ("tgi", EngineOptions(), "needs --model"),
    ("trtllm", EngineOptions(model="m", launch="local"), "no local launcher"),
    ("nope", EngineOptions(), "unknown engine"),
])
def test_impossible_combinations_are_refused(name: str, options: EngineOptions, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_engine(name, None, options)


def test_batching_grid_from_the_command_line() -> None:
    assert parse_batching("default") is None
    assert parse_batching("max_batch_size=16,chunked_prefill=false,memory_fraction=0.5") == BatchingConfig(
        max_batch_size=16, chunked_prefill=False, memory_fraction=0.5)
    with pytest.raises(pytest.UsageError, match="KEY one of"):
        parse_batching("batch=16")
    with pytest.raises(pytest.UsageError, match="positive integer"):
        parse_batching("max_batch_size=0")
