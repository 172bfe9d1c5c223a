"""``batchbench bench`` end to end against the vLLM protocol server, and every bad input refused before a start."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchbench.analysis.validity import samples_needed
from batchbench.cli import main
from batchbench.core.exits import EXIT_ENGINE, EXIT_FAILURES, EXIT_USAGE
from batchbench.core.placement import usable_cpus
from batchbench.experiment.workload import slo_samples
from batchbench.fixtures import tiny_model_dir
from batchbench.measures.slo import Slo
from tests.server_process import serving

needs_two_cpus = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(usable_cpus()) < 2,
                                    reason="needs CPU affinity and two usable CPUs")

#: Nothing listens here: a usage error must be found before anything tries to reach it.
NOWHERE = ["--engine", "vllm", "--engine-url", "vllm=http://127.0.0.1:9"]


@pytest.fixture(scope="module")
def fake_vllm_url() -> Iterator[str]:
    with serving("batchbench.fixtures.protocol", "vllm", "--token-delay", "0.001", "--max-running", "64") as url:
        yield url


def _token_dataset(path: Path) -> Path:
    lines = [{"prompt_token_ids": [5, 6, 7, 8], "output_len": 3}, {"prompt_token_ids": list(range(10, 30))},
             {"prompt_token_ids": [40, 41], "output_len": 6}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_bench_sweeps_a_token_id_dataset_over_concurrencies_with_an_slo(
        fake_vllm_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dataset = _token_dataset(tmp_path / "prompts.jsonl")
    code = main(["bench", "--engine", "vllm", "--engine-url", f"vllm={fake_vllm_url}", "--dataset", str(dataset),
                 "--num-requests", "6", "--concurrency", "1,4", "--slo", "ttft_p99=30s,tpot_p99=10s",
                 "--warmup", "2", "--results-dir", str(tmp_path / "results")])
    out = capsys.readouterr().out
    assert code == 0, out
    (run_dir,) = (tmp_path / "results").glob("bench-*")
    docs = [json.loads(p.read_text()) for p in sorted(run_dir.glob("vllm_*.json"))]
    assert sorted((d["labels"]["concurrency"], d["labels"]["repeat"]) for d in docs) == [(1, 0), (4, 0)]
    for doc in docs:
        assert doc["labels"]["suite"] == "bench" and doc["labels"]["slo"] == "ttft_p99<=30s,tpot_p99<=10s"
        # The dataset's requests in file order, cycled; warm-up requests are not recorded.
        assert sorted((r["prompt_len"], r["max_tokens"]) for r in doc["records"]) == [
            (2, 6), (2, 6), (4, 3), (4, 3), (20, 128), (20, 128)]
        assert doc["slo"] == {"ttft_p99": 30.0, "tpot_p99": 10.0}  # the objectives goodput counted against
        assert doc["summary"]["good"] == 6
    summary = json.loads((run_dir / "bench.json").read_text())
    assert [(r["concurrency"], r["status"], r["slo"]["met"], r["parity"]["ok"]) for r in summary["runs"]] == [
        (1, "ok", True, True), (4, "ok", True, True)]
    assert out.count("6/6 ok") == 2 and out.count("SLO met") == 2
    assert (run_dir / "report" / "report.json").is_file()


def test_a_failing_objective_is_named_on_the_run_line(fake_vllm_url: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--engine", "vllm", "--engine-url", f"vllm={fake_vllm_url}", "--input-len", "8",
                 "--output-len", "4", "--num-requests", "4", "--concurrency", "2", "--slo", "ttft_p50=1us",
                 "--results-dir", str(tmp_path), "--no-report"])
    out = capsys.readouterr().out
    assert code == 0, out  # missing an SLO is a finding, not an error
    assert "SLO failed: ttft_p50=" in out and ">0.001ms" in out
    (run_dir,) = tmp_path.glob("bench-*")
    (run,) = json.loads((run_dir / "bench.json").read_text())["runs"]
    assert run["slo"]["met"] is False and run["goodput"] == 0


def test_a_level_whose_engine_is_gone_is_recorded_as_failed_and_stop_on_error_stops_the_sweep(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 0.1 s a step: the engine's own warm-up (16 tokens a request) passes, but 100 tokens cannot come within
    # the 0.5 s request timeout however slow or fast the machine is (a slower one only times out sooner).
    with serving("batchbench.fixtures.protocol", "vllm", "--token-delay", "0.1", "--max-running", "16") as url:
        code = main(["bench", "--engine", "vllm", "--engine-url", f"vllm={url}", "--input-len", "4",
                     "--output-len", "100", "--num-requests", "2", "--concurrency", "1,2", "--request-timeout", "0.5",
                     "--stop-on-error", "--results-dir", str(tmp_path), "--no-report"])
    captured = capsys.readouterr()
    assert code == EXIT_FAILURES, captured.out + captured.err
    (run_dir,) = tmp_path.glob("bench-*")
    (run,) = json.loads((run_dir / "bench.json").read_text())["runs"]  # c=2 never ran
    assert run["status"] == "failed" and run["reason"] == "all 2 requests timed out (--request-timeout 0.5s)"
    assert "stopping the sweep (--stop-on-error): c=1 #0 failed" in captured.err
    assert len(list(run_dir.glob("vllm_*.json"))) == 1  # the failed level's results are kept


@pytest.mark.parametrize("fault", ["hang", "silent"])
def test_a_warm_up_that_hangs_ends_the_start_within_the_request_timeout_naming_request_and_url(
        fault: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # hang: every stream stops after three chunks; silent: no request gets even its response headers.
    with serving("batchbench.fixtures.protocol", "vllm", "--fault", fault, "--fault-after", "3") as url:
        t0 = time.monotonic()
        code = main(["bench", "--engine", "vllm", "--engine-url", url, "--input-len", "4", "--output-len", "4",
                     "--num-requests", "2", "--request-timeout", "2", "--results-dir", str(tmp_path), "--no-report"])
        elapsed = time.monotonic() - t0
    captured = capsys.readouterr()
    assert code == EXIT_ENGINE, captured.out + captured.err
    assert elapsed < 2 + 3, f"the start took {elapsed:.1f}s"
    assert "vllm: waiting for its warm-up (16 requests, none silent for 2s)" in captured.out
    (line,) = [line for line in captured.err.splitlines() if "cannot run" in line]
    got = "after 3 of 16 tokens the stream stopped" if fault == "hang" else "no response at all"
    assert "request warm-up-0000" in line and f"warm-up to {url}: the engine sent nothing for 2s ({got})" in line


@pytest.fixture(scope="module")
def served_as_a_name() -> Iterator[str]:
    """vLLM serving the embedded model from its folder under a name of its own (``--served-model-name``)."""
    with serving("batchbench.fixtures.protocol", "vllm", "--token-delay", "0.001", "--model", "tiny-llama",
                 "--model-root", str(tiny_model_dir())) as url:
        yield url


@pytest.mark.parametrize("model", [None, "tiny-llama", "path", "relative path"])
def test_at_a_url_model_is_the_served_name_or_its_path_and_the_tokenizer_is_the_served_root(
        served_as_a_name: str, model: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    if model == "relative path":
        monkeypatch.chdir(tiny_model_dir().parent)
    given = {"path": str(tiny_model_dir()), "relative path": f"./{tiny_model_dir().name}"}.get(model or "", model)
    dataset = tmp_path / "text.jsonl"
    dataset.write_text('{"prompt": "hello there world", "output_len": 3}\n{"prompt": "a b c d", "output_len": 2}\n')
    code = main(["bench", "--engine", "vllm", "--engine-url", served_as_a_name, *(["--model", given] if given else []),
                 "--dataset", str(dataset), "--num-requests", "4", "--concurrency", "2",
                 "--results-dir", str(tmp_path / "results"), "--no-report"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"serves tiny-llama (from {tiny_model_dir()}); requests name tiny-llama" in out
    assert f"tokenizer {tiny_model_dir()} (the served model's root on /v1/models)" in out
    (doc,) = [json.loads(p.read_text()) for p in (tmp_path / "results").glob("bench-*/vllm_*.json")]
    assert doc["summary"]["ok"] == 4  # a path sent as the model would have been refused (404)
    assert doc["engine"]["model"]["path"] == str(tiny_model_dir())


@pytest.mark.parametrize("command", [["bench", "--input-len", "4"], ["capacity", "--slo", "ttft_p99=1s"], ["run"]])
def test_at_a_url_a_model_it_does_not_serve_fails_before_start_naming_the_served_ones(
        served_as_a_name: str, command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error([*command, "--engine", "vllm", "--engine-url", served_as_a_name, "--model", "org/other",
                        "--results-dir", str(tmp_path)], capsys)
    assert f"--model org/other: vllm at {served_as_a_name} serves no such model; it serves: tiny-llama (from " \
           f"{tiny_model_dir()})" in err


def test_a_malformed_engine_url_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(["bench", "--engine", "vllm", "--engine-url", "engine-host:8080", "--input-len", "4",
                        "--results-dir", str(tmp_path)], capsys)
    assert "invalid URL 'engine-host:8080': expected http(s)://host:port" in err and "Traceback" not in err


def test_an_engine_that_cannot_be_reached_is_an_engine_error(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *NOWHERE, "--input-len", "4", "--output-len", "4", "--num-requests", "2",
                 "--results-dir", str(tmp_path), "--no-report"]) == EXIT_ENGINE
    assert "vllm cannot run" in capsys.readouterr().err


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Runs the CLI expecting exit status 2 (argparse's or the command's own); returns what it printed."""
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    assert code == EXIT_USAGE, captured.out + captured.err
    assert "results in" not in captured.out, "a usage error must be found before anything is written or started"
    return captured.err


@pytest.mark.parametrize(("extra", "message"), [
    (["--slo", "ttft_p99=200"], "is not a duration"),
    (["--slo", "latency=200ms"], "expected METRIC_STAT=LIMIT"),
    (["--rate", "0"], "a rate must be more than 0 requests/s, not 0"),
    (["--rate", "2,-1"], "a rate must be more than 0 requests/s, not -1"),
    (["--concurrency", "0"], "a concurrency must be at least 1, not 0"),
    (["--concurrency", "1,x"], "expected whole numbers separated by commas"),
    (["--input-len", "2000", "--output-len", "100"], "exceeds the model's max length 2048"),
    (["--input-len", "uniform:64"], "expected N, fixed:N, uniform:LOW:HIGH"),
    (["--input-len", "uniform:9:3"], "need value >= 1 and 1 <= low <= high"),
    (["--burstiness", "0.5"], "--burstiness is the shape of gamma arrivals"),
    (["--rate", "inf", "--duration", "5"], "--duration with --rate inf"),
])
def test_bad_options_are_usage_errors_before_any_engine_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    err = _usage_error(["bench", *NOWHERE, "--results-dir", str(tmp_path), *extra], capsys)
    assert message in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("cpus", "message"), [
    ("engine=0,client=0", "--cpus 'engine=0,client=0': the engine and the client share CPU 0"),
    ("engine=1", "--cpus 'engine=1': client= is missing"),
    ("engine=x,client=0", "--cpus 'engine=x,client=0': engine='x': 'x' is not a CPU number"),
    ("engine=4000,client=0", "engine CPU 4000 is not one this process may use"),
    ("engine=,client=0", "engine= names no CPU"),
])
def test_a_bad_cpus_is_a_usage_error_before_any_engine_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], cpus: str, message: str) -> None:
    for command in (["bench"], ["capacity", "--slo", "ttft_p99=1s"], ["run"]):
        err = _usage_error([*command, *NOWHERE, "--results-dir", str(tmp_path), "--cpus", cpus], capsys)
        assert message in err, err
    assert not list(tmp_path.iterdir())


@needs_two_cpus
def test_each_results_document_records_the_placement_applied(fake_vllm_url: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    before = os.sched_getaffinity(0)
    engine, client = max(usable_cpus()), min(usable_cpus())
    base = ["bench", "--engine", "vllm", "--engine-url", f"vllm={fake_vllm_url}", "--input-len", "4",
            "--output-len", "4", "--num-requests", "6", "--concurrency", "3", "--no-report"]
    assert main([*base, "--results-dir", str(tmp_path / "placed"), "--workers", "2",
                 "--cpus", f"engine={engine},client={client}"]) == 0
    out = capsys.readouterr().out
    assert f"engine on CPU {engine}, load generator on CPU {client} (--cpus)" in out
    (doc,) = [json.loads(p.read_text()) for p in (tmp_path / "placed").glob("bench-*/vllm_*.json")]
    # The engine at a URL is not ours to place; the measuring process and both workers share the one client CPU.
    assert doc["placement"] == {"source": "--cpus", "applied": True, "engine": "at a URL", "engine_cpus": None,
                                "client_cpus": [[client], [client], [client]], "shared": True, "reason": None}
    assert os.sched_getaffinity(0) == before  # the command gave this process its CPUs back

    assert main([*base, "--results-dir", str(tmp_path / "off"), "--cpus", "none"]) == 0
    assert "no CPU placement: turned off (--cpus none)" in capsys.readouterr().out
    (doc,) = [json.loads(p.read_text()) for p in (tmp_path / "off").glob("bench-*/vllm_*.json")]
    assert doc["placement"] == {"source": None, "applied": False, "engine": "at a URL", "engine_cpus": None,
                                "client_cpus": [sorted(before)], "shared": False,
                                "reason": "turned off (--cpus none)"}

    assert main([*base, "--results-dir", str(tmp_path / "default")]) == 0
    assert f"load generator on CPU {client} (the default" in capsys.readouterr().out
    (doc,) = [json.loads(p.read_text()) for p in (tmp_path / "default").glob("bench-*/vllm_*.json")]
    assert doc["placement"]["source"] == "default" and doc["placement"]["client_cpus"] == [[client]]
    assert os.sched_getaffinity(0) == before


@pytest.mark.parametrize(("content", "message"), [
    ("", "no prompts in it"),
    ("\n\n", "no prompts in it"),
    ('{"prompt_token_ids": [1, 2]}\n{"prompt_token_ids": [1, 2\n', "prompts.jsonl:2: not JSON"),
    ('{"prompt_token_ids": []}\n', "prompts.jsonl:1: prompt_token_ids must be a non-empty list"),
    ('{"prompt_token_ids": [3], "output_length": 4}\n', "prompts.jsonl:1: unknown key(s) output_length"),
    ('{"prompt_token_ids": [3], "output_len": 0}\n', "prompts.jsonl:1: output_len must be a whole number"),
    ('[1, 2]\n', "prompts.jsonl item 1: expected"),
    ('{"prompt_token_ids": [5], "output_len": 4000}\n', "prompts.jsonl:1: prompt (1 tokens) + output (4000) exceeds"),
])
def test_a_bad_dataset_is_a_usage_error_naming_the_file_and_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(content)
    err = _usage_error(["bench", *NOWHERE, "--dataset", str(dataset), "--results-dir", str(tmp_path / "r")], capsys)
    assert message in err


def test_a_text_dataset_needs_a_tokenizer_that_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dataset = tmp_path / "text.jsonl"
    dataset.write_text('{"prompt": "Hello there"}\n')
    base = ["bench", *NOWHERE, "--dataset", str(dataset), "--results-dir", str(tmp_path / "r")]
    assert "give --tokenizer (or --model)" in _usage_error(base, capsys)
    missing = str(tmp_path / "no-such-tokenizer")
    assert f"tokenizer {missing!r} cannot be loaded" in _usage_error([*base, "--tokenizer", missing], capsys)


def test_capacity_needs_an_slo_and_consistent_bounds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "--slo" in _usage_error(["capacity", *NOWHERE], capsys)
    err = _usage_error(["capacity", *NOWHERE, "--slo", "ttft_p99=1s", "--start", "8", "--max", "4"], capsys)
    assert "start (8) <= max (4)" in err
    assert "must be a finite number more than 0" in _usage_error(
        ["capacity", *NOWHERE, "--slo", "ttft_p99=1s", "--start", "0"], capsys)


def test_a_p99_objective_raises_the_default_request_count_to_what_a_p99_needs() -> None:
    assert slo_samples(None) == 0
    assert slo_samples(Slo.parse("ttft_p99=200ms")) == samples_needed(99) == 200
    assert slo_samples(Slo.parse("ttft_p50=1s,e2e_max=2s")) == samples_needed(50)  # max needs no tail
