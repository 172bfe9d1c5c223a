"""Any endpoint a user runs, end to end through the CLI and the suites: a key-protected, chat-only OpenAI-compatible
server measured with ``--engine openai``, the key in no file or output, a missing key said within seconds, and a
reasoning stream's TTFT and time to first output token apart in the report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchbench.cli import main
from batchbench.core.exits import EXIT_USAGE
from batchbench.fixtures import tiny_model_dir
from batchbench.measures.metrics import itl_samples
from batchbench.results import document as results
from tests.server_process import ROOT, serving

KEY = "sk-e2e-3c1f09d2b7aa"
#: What a chat-only gateway guarding its routes with a key looks like, serving the tiny model from its folder (its
#: /v1/models root is the tokenizer batchbench reads text prompts with, as a real vLLM's is).
GATEWAY = ("batchbench.fixtures.protocol", "openai", "--chat-only", "--api-key", KEY, "--token-delay", "0.001",
           "--max-running", "16", "--model", "tiny-llama", "--model-root", str(tiny_model_dir()))


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    with serving(*GATEWAY, ready_path="/v1/models", headers={"Authorization": f"Bearer {KEY}"}) as url:
        yield url


def _batchbench(*argv: str, cwd: Path, env: dict[str, str] | None = None,
                timeout: float = 300) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "batchbench", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)
    return done, time.monotonic() - t0


def _files_holding(root: Path, secret: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def test_bench_measures_a_chat_only_key_protected_server_and_the_key_is_nowhere(gateway: str, tmp_path: Path) -> None:
    done, _ = _batchbench("bench", "--engine", "openai", "--engine-url", f"openai={gateway}", "--api-key", KEY,
                          "--endpoint", "chat", "--concurrency", "1,4", "--num-requests", "20",
                          "--results-dir", str(tmp_path / "results"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = (tmp_path / "results").glob("bench-*")
    docs = [results.load(p) for p in sorted(run_dir.glob("openai_*.json"))]
    assert sorted(d.header.labels.concurrency for d in docs) == [1, 4]
    for doc in docs:
        assert doc.header.engine.details["endpoint"] == "chat" and doc.header.engine.details["auth"]["api_key"] == "***"
        assert len(doc.records) == 20
        for r in doc.records:  # every record with TTFT, ITL and the engine's own token counts
            assert r.ok and r.ttft_s is not None and itl_samples(r) and r.usage_from is None
            assert r.completion_tokens == r.max_tokens == 128 and r.prompt_tokens is not None
            assert r.prompt_tokens - r.prompt_len == 4  # the server's chat template: 3 per message + 1
    assert "the chat template added 4 prompt tokens per request" in done.stdout
    bench = json.loads((run_dir / "bench.json").read_text())
    assert all(run["parity"]["ok"] and run["parity"]["template_tokens"] == [4, 4] for run in bench["runs"])
    assert (run_dir / "report" / "report.html").is_file()
    assert not _files_holding(tmp_path, KEY)
    assert KEY not in done.stdout + done.stderr
    assert "not measurable on engine 'openai': server metrics" in (run_dir / "report" / "report.md").read_text()


def test_run_sweeps_a_chat_only_key_protected_server(gateway: str, tmp_path: Path) -> None:
    """The main job over chat: the sweep's token-id requests sent as text of the same lengths, the chat template's
    tokens counted by the server, the key in no file or output."""
    done, _ = _batchbench("run", "--engine", "openai", "--engine-url", f"openai={gateway}", "--api-key", KEY,
                          "--endpoint", "chat", "--levels", "1,2", "--repeats", "1", "--max-repeats", "1",
                          "--time-limit", "60", "--results-dir", str(tmp_path / "results"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = (tmp_path / "results").glob("run-*")
    docs = [results.load(p) for p in sorted(run_dir.glob("openai_*.json"))]
    assert {d.header.labels.concurrency for d in docs} >= {1, 2}
    for doc in docs:
        assert doc.header.engine.details["endpoint"] == "chat"
        assert doc.records and all(r.ok and r.prompt_tokens is not None and r.prompt_tokens - r.prompt_len == 4
                                   for r in doc.records)
    assert (run_dir / "report" / "report.html").is_file()
    assert not _files_holding(tmp_path, KEY) and KEY not in done.stdout + done.stderr


def test_run_over_chat_needs_a_tokenizer_it_can_load(tmp_path: Path) -> None:
    """At a URL whose /v1/models root is nothing batchbench can load, and without --model, the main job cannot
    make prompts of the asked lengths: a usage error that says to give --model, before anything is measured."""
    with serving("batchbench.fixtures.protocol", "openai", "--model", "org/unknown-model", "--model-root",
                 str(tmp_path / "no-such-folder"), ready_path="/v1/models") as url:
        done, took = _batchbench("run", "--engine", "openai", "--engine-url", f"openai={url}", "--endpoint", "chat",
                                 "--results-dir", str(tmp_path / "results"), cwd=tmp_path, timeout=120)
    assert done.returncode == EXIT_USAGE, done.stdout[-2000:] + done.stderr[-2000:]
    assert "--endpoint chat sends text, tokenised as the served model does" in done.stderr
    assert "give --model" in done.stderr and took < 30


@pytest.mark.parametrize(("key", "said"), [(None, "wants an API key"), ("sk-wrong-0000", "refused the API key")])
def test_without_the_right_key_bench_stops_within_seconds_saying_so(gateway: str, tmp_path: Path, key: str | None,
                                                                    said: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    done, took = _batchbench("bench", "--engine", "openai", "--engine-url", f"openai={gateway}", "--endpoint", "chat",
                             "--concurrency", "1,4", "--num-requests", "20", *(["--api-key", key] if key else []),
                             "--results-dir", str(tmp_path / "results"), cwd=tmp_path, env=env, timeout=60)
    assert done.returncode == EXIT_USAGE and took < 10, (took, done.stderr)
    assert f"HTTP 401 from {gateway}/v1/models: the endpoint {said}" in done.stderr
    assert not (tmp_path / "results").exists()  # found before anything started
    assert "sk-wrong-0000" not in done.stdout + done.stderr


def test_the_key_comes_from_openai_api_key(gateway: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    code = main(["bench", "--engine", "openai", "--engine-url", f"openai={gateway}", "--endpoint", "chat",
                 "--concurrency", "2", "--num-requests", "4", "--input-len", "16", "--output-len", "4",
                 "--results-dir", str(tmp_path / "results"), "--no-report"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert KEY not in out + err and not _files_holding(tmp_path, KEY)


@pytest.mark.parametrize(("argv", "said"), [
    (["--engine", "openai"], "engine 'openai' is any server someone else runs: give its URL"),
    (["--engine", "sglang", "--engine-url", "sglang=http://127.0.0.1:9", "--endpoint", "chat"],
     "engine 'sglang' has no chat endpoint batchbench can send (--endpoint chat)"),
    (["--engine", "openai", "--engine-url", "openai=http://127.0.0.1:9", "--header", "X-Tenant"],
     "--header X-Tenant=...: expected NAME=VALUE"),
    (["--engine", "openai", "--engine-url", "openai=http://127.0.0.1:9", "--endpoint", "chat", "--trace",
      "x.jsonl", "--rate", "1"], "--trace with --endpoint chat"),
])
def test_what_cannot_be_sent_is_a_usage_error(argv: list[str], said: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv, "--results-dir", str(tmp_path)]) == EXIT_USAGE
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_server_refusing_fields_beyond_openais_api_is_sent_openais_alone(endpoint: str, tmp_path: Path) -> None:
    """OpenAI's own API answers 400 "Unrecognized request argument supplied: ignore_eos" to vLLM's extensions: the
    warm-up's first request turns them off, every request after is accepted, and the report says lengths are the
    model's."""
    with serving("batchbench.fixtures.protocol", "openai", "--strict", "--token-delay", "0.001", "--model",
                 "tiny-llama", "--model-root", str(tiny_model_dir()), ready_path="/v1/models") as url:
        done, _ = _batchbench("bench", "--engine", "openai", "--engine-url", f"openai={url}", "--endpoint", endpoint,
                              "--concurrency", "2", "--num-requests", "6", "--input-len", "16", "--output-len", "8",
                              "--results-dir", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("bench-*/openai_*.json")
    doc = results.load(path)
    assert len(doc.records) == 6 and all(r.ok and r.completion_tokens == 8 for r in doc.records)
    assert "the server refused min_tokens/ignore_eos" in doc.header.engine.details["unavailable"]
    report = next(tmp_path.glob("bench-*/report/report.md")).read_text()
    assert "the server refused min_tokens/ignore_eos" in report


@pytest.mark.parametrize(("status", "said", "plain"), [
    (400, "Unrecognized request argument supplied: ignore_eos", True),
    (422, "min_tokens: extra fields not permitted", True),
    (400, "prompt (16) + max_tokens (60) exceeds 64", False),  # the user's to see, not an extension's refusal
    (500, "ignore_eos crashed the server", False),
])
async def test_only_a_refusal_naming_an_extension_turns_them_off(
        status: int, said: str, plain: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server refuses every request that carries the extensions: one naming them is sent again without them
    (and is then accepted); any other refusal is raised as it came, the request not sent again."""
    from batchbench.adapters.base import EngineHTTPError
    from batchbench.adapters.generic import OpenAIServerEngine
    from batchbench.adapters.openai_compat import OpenAICompletionsEngine
    from batchbench.core.config import ModelRef
    from batchbench.workload.requests import Arrival, Lengths, Request, WorkloadSpec

    sent: list[dict[str, object]] = []

    async def server(self: OpenAIServerEngine, request: Request, sink: object) -> None:
        sent.append(self.payload(request))
        if "ignore_eos" in sent[-1]:
            raise EngineHTTPError("openai", f"HTTP {status} from URL: {said}", status=status)

    monkeypatch.setattr(OpenAICompletionsEngine, "stream_into", server)
    engine = OpenAIServerEngine(model=ModelRef("m"), url="http://127.0.0.1:9")
    (request,) = WorkloadSpec("w", 1, prompt=Lengths.fixed(4), output=Lengths.fixed(4),
                              arrival=Arrival("closed", concurrency=1)).build().requests
    if plain:
        await engine.stream_into(request, None)  # type: ignore[arg-type]
    else:
        with pytest.raises(EngineHTTPError, match=re.escape(said)):
            await engine.stream_into(request, None)  # type: ignore[arg-type]
    assert engine.plain is plain and len(sent) == (2 if plain else 1)
    assert sent[-1].get("ignore_eos") is (None if plain else True)
    assert sent[-1].get("stream_options") == ({"include_usage": True} if plain else
                                              {"include_usage": True, "continuous_usage_stats": True})


def test_a_reasoning_stream_gives_ttft_and_ttfo_apart_in_the_report_and_an_slo(tmp_path: Path) -> None:
    with serving("batchbench.fixtures.protocol", "openai", "--reasoning-tokens", "6", "--token-delay", "0.003",
                 "--model", "tiny-llama", "--model-root", str(tiny_model_dir()), ready_path="/v1/models") as url:
        done, _ = _batchbench("bench", "--engine", "openai", "--engine-url", f"openai={url}", "--endpoint", "chat",
                              "--concurrency", "2", "--num-requests", "8", "--input-len", "16", "--output-len", "10",
                              "--slo", "ttfo_p99=10ms", "--results-dir", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # six reasoning tokens at 3 ms each come before the answer: the TTFO objective fails, TTFT alone would not
    line = next(line for line in done.stdout.splitlines() if "openai c=2" in line)
    assert "6.0 reasoning tok/req" in line and "SLO failed: ttfo_p99=" in line
    report = next(tmp_path.glob("bench-*/report/report.md")).read_text()
    ttft = float(re.search(r"\| TTFT p50 \(ms\) \| ([\d.]+) \|", report).group(1))  # type: ignore[union-attr]
    ttfo = float(re.search(r"\| TTFO p50 \(ms\) \| ([\d.]+) \|", report).group(1))  # type: ignore[union-attr]
    assert ttfo - ttft >= 6 * 3 * 0.8
    assert "| Reasoning tokens / request | 6.00 |" in report


@pytest.mark.slow
def test_the_suites_run_on_a_key_protected_server_over_chat_and_skip_with_the_reason(tmp_path: Path) -> None:
    with serving("batchbench.fixtures.protocol", "openai", "--api-key", KEY, "--token-delay", "0.005",
                 ready_path="/v1/models", headers={"Authorization": f"Bearer {KEY}"}) as url:
        done = subprocess.run([sys.executable, "-m", "pytest", "suites", "-q", "-p", "no:cacheprovider", "-rs",
                               "--benchmark-disable", "--results-dir", str(tmp_path), "--engine", "openai",
                               "--engine-url", f"openai={url}", "--api-key", KEY, "--endpoint", "chat"],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
    tail = done.stdout[-4000:]
    assert done.returncode == 0, tail
    assert int(re.search(r"(\d+) passed", tail).group(1)) >= 10, tail  # type: ignore[union-attr]
    assert "openai exposes no server metrics" in tail  # skipped where it cannot, with the reason
    docs = list(tmp_path.glob("pytest-*/openai_*.json"))
    assert docs and all(json.loads(p.read_text())["engine"]["endpoint"] == "chat" for p in docs)
    assert not _files_holding(tmp_path, KEY) and KEY not in done.stdout + done.stderr
