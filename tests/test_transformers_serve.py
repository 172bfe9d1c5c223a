"""Hugging Face's own server, ``transformers serve`` (5.19), measured through the generic engine as a user would.

It differs from the OpenAI spec where batchbench's requests meet it: its ``/v1/models`` lists only models in the Hub
cache (``[]`` with an empty cache folder, a 500 with none) though it serves the model it was started with; it refuses
token-id prompts (400 "prompt must be a string.") and ``ignore_eos``/``min_tokens`` (422); its streams carry usage
on the last choice event and end without ``data: [DONE]``. Its own switch, ``--continuous-batching`` against
``--no-continuous-batching`` (``model.generate()`` on one request at a time), is a second implementation of the
static-vs-continuous comparison that nobody here wrote.

Each server starts in a few seconds on the tiny Llama's seeded weights, written once
(:func:`~batchbench.adapters.launch.weights.seeded_folder`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from batchbench.adapters.generic import AS_TEXT, REFUSED
from batchbench.adapters.launch.local import free_port
from batchbench.adapters.launch.weights import seeded_folder
from batchbench.fixtures import tiny_model_dir
from tests.adapter_helpers import bench_openai

pytestmark = [pytest.mark.engine, pytest.mark.slow]

#: The command of issue 47, less the URL and the model folder.
BENCH = ("--engine", "openai", "--concurrency", "1,8", "--num-requests", "16", "--input-len", "32",
         "--output-len", "16")


@pytest.fixture(scope="module")
def model() -> Path:
    return seeded_folder(tiny_model_dir())


Serve = Callable[[str], str]


@pytest.fixture(scope="module")
def serve(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    """Starts ``transformers serve MODEL --<mode>`` once per mode, its URL: continuous batching with an empty Hub
    cache folder (``/v1/models`` lists none), the other with no cache folder at all (``/v1/models`` answers 500)."""
    if subprocess.run([sys.executable, "-c", "import fastapi, uvicorn, accelerate"], check=False).returncode:
        pytest.skip("transformers serve needs its serving extra: pip install -e '.[serve]'")
    running: dict[str, tuple[subprocess.Popen[bytes], str]] = {}

    def start(mode: str) -> str:
        if mode in running:
            return running[mode][1]
        home = tmp_path_factory.mktemp(f"hf-{mode}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env["HF_HOME"] = str(home / "home")  # no such folder: a 500 from /v1/models
        if mode == "continuous-batching":
            (home / "hub").mkdir()
            env["HF_HUB_CACHE"] = str(home / "hub")  # an empty cache folder: no model listed
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "transformers.cli.transformers", "serve", str(model),
                                 f"--{mode}", "--port", str(port), "--host", "127.0.0.1", "--device", "cpu"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        url = f"http://127.0.0.1:{port}"
        running[mode] = (proc, url)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    return url
            except httpx.TransportError:
                pass
            assert proc.poll() is None, f"transformers serve --{mode} exited with {proc.returncode}"
            time.sleep(0.1)
        pytest.fail(f"transformers serve --{mode} not healthy in 120 s")

    try:
        yield start
    finally:
        for proc, _ in running.values():
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("mode", ["continuous-batching", "no-continuous-batching"])
def test_the_issue_command_measures_both_modes(serve: Serve, model: Path, tmp_path: Path, mode: str) -> None:
    url = serve(mode)
    listing = httpx.get(url + "/v1/models")
    assert (listing.status_code, listing.json()["data"]) == (200, []) if mode == "continuous-batching" \
        else listing.status_code == 500
    done, docs = bench_openai(tmp_path, *BENCH, "--engine-url", f"openai={url}", "--model", str(model))
    assert done.returncode == 0, done.stderr
    assert "does not list --model" in done.stdout
    assert len(docs) == 2  # c=1 and c=8
    for doc in docs:
        assert len(doc.records) == 16 and all(r.ok for r in doc.records)
        for r in doc.records:
            # The engine's own counts: the text sent is exactly the workload's prompt length under its tokenizer.
            assert (r.prompt_tokens, r.usage_from) == (r.prompt_len, "engine-last-choice")
            assert r.completion_tokens is not None and 0 < r.completion_tokens <= r.max_tokens
        unavailable = doc.header.engine.details["unavailable"]
        assert AS_TEXT in unavailable and REFUSED in unavailable


def test_chat_through_the_model_s_template(serve: Serve, model: Path, tmp_path: Path) -> None:
    done, docs = bench_openai(tmp_path, "--engine", "openai", "--engine-url",
                              f"openai={serve('continuous-batching')}", "--model", str(model), "--endpoint", "chat",
                              "--concurrency", "4", "--num-requests", "8", "--input-len", "32", "--output-len", "8")
    assert done.returncode == 0, done.stderr
    (doc,) = docs
    assert len(doc.records) == 8 and all(r.ok for r in doc.records)
    assert all(r.prompt_tokens is not None and r.prompt_tokens > r.prompt_len for r in doc.records)  # the template
    assert "the chat template added" in done.stdout


def test_a_wrong_model_ends_in_one_line_within_seconds(serve: Serve, model: Path, tmp_path: Path) -> None:
    url = serve("continuous-batching")
    started = time.monotonic()
    done, docs = bench_openai(tmp_path, *BENCH, "--engine-url", f"openai={url}", "--model", "org/not-served",
                              "--tokenizer", str(model))
    assert time.monotonic() - started < 30
    assert done.returncode == 3 and not docs
    said = [line for line in done.stderr.splitlines() if "cannot run" in line]
    assert len(said) == 1 and f"Server is pinned to '{model}'; requested 'org/not-served'" in said[0]


def test_continuous_batching_against_its_own_sequential_mode(serve: Serve, model: Path, tmp_path: Path) -> None:
    """The same workload at 8 in flight, 3 repeats on each mode, compared as the suites compare: by intervals."""
    folders = []
    for mode in ("no-continuous-batching", "continuous-batching"):
        out = tmp_path / mode
        out.mkdir()
        done, _ = bench_openai(out, "--engine", "openai", "--engine-url", f"openai={serve(mode)}", "--model",
                               str(model), "--concurrency", "8", "--num-requests", "16", "--input-len", "32",
                               "--output-len", "16", "--repeats", "3")
        assert done.returncode == 0, done.stderr
        (folder,) = out.glob("bench-*")
        folders.append(folder)
    compared = subprocess.run([sys.executable, "-m", "batchbench", "compare", *map(str, folders), "--json"],
                              capture_output=True, text=True, timeout=120, check=True)
    (series,) = json.loads(compared.stdout)["series"]
    assert (series["a_repeats"], series["b_repeats"]) == (3, 3)
    throughput = next(m for m in series["metrics"] if m["metric"] == "output_token_throughput")
    # B (continuous batching) against A (one request at a time): more than 10% and outside A's interval.
    assert throughput["verdict"] == "improved", throughput
