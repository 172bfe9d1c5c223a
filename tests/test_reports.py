"""Tests for reports/: realistic results documents in, report content out.

Every document is written with the harness's own ResultsWriter, RequestRecord
and ServerMetrics, so the report is tested against the real format. Stored
summaries are deliberately given figures that differ from what the records
would give, so a report that recomputed metrics instead of reading the
stored summary would fail.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.analysis.repeats import Estimate
from batchbench.cli import main
from batchbench.core import codec
from batchbench.core.config import BatchingConfig, EngineDescription, LoadConfig
from batchbench.core.greedy import GreedyOutputs
from batchbench.core.records import RequestRecord
from batchbench.core.server_metrics import ServerMetrics
from batchbench.measures.guardrails import server_summary
from batchbench.measures.metrics import Summary, summarize, ttft_by_bucket
from batchbench.reports.build import build, build_report
from batchbench.reports.compare import delta
from batchbench.reports.markdown import escape as md_escape
from batchbench.results.claims import Claim, read_claims, write_claims
from batchbench.results.document import RunDocument, RunFooter, RunHeader, RunLabels, ScrapeStats
from batchbench.results.greedy import write_greedy
from batchbench.results.journal import JournalWriter
from batchbench.workload.requests import Arrival, Lengths, Workload, WorkloadSpec, WorkloadSummary

ROOT = Path(__file__).resolve().parent.parent
ENV = {"hostname": "bench-01", "platform": "Linux-6.8-x86_64", "python": "3.11.9", "cpu": "Test CPU",
       "cpu_count": 16, "gpus": [], "packages": {"batchbench": "0.1.0"}, "batchbench_commit": "abc123"}


# --------------------------------------------------------------------------- synthetic runs


def chat_workload(concurrency: int = 4, n: int = 24) -> Workload:
    return WorkloadSpec("chat", n, prompt=Lengths.uniform(16, 64), output=Lengths.fixed(8),
                        arrival=Arrival("closed", concurrency=concurrency)).build()


def make_records(workload: Workload, *, ttft: float, tpot: float, concurrency: int,
                 failed: int = 0) -> list[RequestRecord]:
    """Closed-loop-like timings: TTFT grows with the number of requests in flight."""
    records = []
    for i, req in enumerate(workload.requests):
        in_flight = 1 + i % concurrency
        sched = (i // concurrency) * (ttft + tpot * req.max_tokens)
        sent = sched + 0.0005
        first = sent + ttft * in_flight
        chunks = [first + k * tpot for k in range(req.max_tokens)]
        ok = i >= failed
        records.append(RequestRecord(
            request_id=req.request_id, prompt_len=req.prompt_len, max_tokens=req.max_tokens, scheduled_s=sched,
            sent_s=sent, done_s=chunks[-1] + 0.0002 if ok else sent + 0.01,
            chunk_times=chunks if ok else [], chunk_tokens=[1] * len(chunks) if ok else [],
            prompt_tokens=req.prompt_len if ok else None, completion_tokens=req.max_tokens if ok else None,
            finish_reason="length" if ok else None, ok=ok, error_kind=None if ok else "rejected",
            error=None if ok else "HTTP 429", in_flight_at_send=in_flight,
        ))
    return records


def make_samples(*, peak_kv: float | None, n: int = 20, preempt_step: float = 0.0,
                 max_waiting: float = 3.0) -> list[ServerMetrics]:
    """A KV curve rising to ``peak_kv`` mid-run; cumulative counters start at an engine-lifetime offset."""
    out = []
    for i in range(n):
        rise = 1 - abs(i - n // 2) / (n // 2)
        out.append(ServerMetrics(
            t=i * 0.25, running=4.0, waiting=round(max_waiting * rise),
            kv_usage=None if peak_kv is None else round(peak_kv * rise, 6),
            kv_capacity_tokens=4096.0 if peak_kv is not None else None,
            preemptions=100.0 + preempt_step * i, rejections=7.0,
        ))
    return out


def _deep_set(doc: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        doc = doc[p]
    doc[last] = value


def write_run(folder: Path, *, engine: str = "vllm", batching: BatchingConfig | None = None,
              workload: Workload | None = None, labels: dict[str, Any] | None = None, ttft: float = 0.02,
              tpot: float = 0.005, concurrency: int = 4, failed: int = 0, peak_kv: float | None = 0.5,
              preempt_step: float = 0.0, stored: dict[str, Any] | None = None,
              engine_report: dict[str, Any] | None = None, finish: bool = True, name: str | None = None) -> Path:
    """Write one run exactly as batchbench.load.runner does;
    ``stored`` overrides summary fields ("ttft.p50": 0.0123)."""
    batching = batching or BatchingConfig("continuous", max_batch_size=concurrency)
    workload = workload or chat_workload(concurrency)
    labels = {"concurrency": concurrency} if labels is None else labels
    name = name or f"{engine}_{batching.label()}_{workload.name}_c{concurrency}"
    writer = JournalWriter(folder / f"{name}.json")
    writer.begin(RunHeader(
        run_id=name, started_at="2025-01-01T00:00:00+0000",
        engine=EngineDescription(engine=engine, batching=batching, details={"versions": {engine: "1.0"}}),
        workload=workload.describe(), load=LoadConfig(request_timeout_s=60), environment=ENV,
        labels=RunLabels.of(labels),
    ))
    records = make_records(workload, ttft=ttft, tpot=tpot, concurrency=concurrency, failed=failed)
    samples = make_samples(peak_kv=peak_kv, preempt_step=preempt_step)
    for r in records:
        writer.record(r)
    for s in samples:
        writer.sample(s)
    if not finish:
        writer.close()  # what a kill leaves: the journal, flushed line by line
        with open(writer.journal_path, "a", encoding="utf-8") as fh:
            fh.write('{"type":"record","request_id":"torn')  # the write the kill cut short
        return writer.journal_path
    duration = max(r.done_s or 0.0 for r in records)
    summary = codec.encode(summarize(records, duration_s=duration))
    for key, value in (stored or {}).items():
        _deep_set(summary, key, value)
    writer.finish(RunFooter(status="complete", error=None, finished_at="2025-01-01T00:01:00+0000",
                            duration_s=duration, engine_report=engine_report or {},
                            scrape=ScrapeStats(failures=0, last_error=None), summary=read_summary(summary),
                            guardrails=server_summary(samples)))
    return writer.path


def read_summary(summary: dict[str, Any]) -> Summary:
    """A summary given as its JSON form (so a test can set any stored figure), read as the document reads it."""
    header = RunHeader(run_id="x", engine=EngineDescription(engine="x", batching=BatchingConfig()),
        workload=WorkloadSummary(name="x", hash=""))
    raw = RunDocument(header=header, footer=RunFooter(status="complete")).to_dict() | {"summary": summary}
    footer = RunDocument.from_dict(raw).footer
    assert footer is not None and footer.summary is not None
    return footer.summary


def build_quiet(results: Path, out: Path, *, plots: bool = False, **kwargs: Any) -> tuple[Any, list[str]]:
    """Build, collecting warnings; figures only where a test looks at them (they take a second each)."""
    warnings: list[str] = []
    result = build_report(results, out, warn=warnings.append, plots=plots, **kwargs)
    return result, warnings


def md_table_after(md: str, heading: str) -> list[list[str]]:
    """The first Markdown table after ``heading``, as rows of cell texts (bold markers removed)."""
    lines = md[md.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        raw = re.split(r"(?<!\\)\|", line.strip())[1:-1]
        cells = [re.sub(r"\\(.)", r"\1", c.strip().replace("**", "")) for c in raw]  # as a Markdown reader sees it
        if not all(set(c) <= set("-:") for c in cells):
            rows.append(cells)
    return rows


def column(table: list[list[str]], header_part: str) -> dict[str, str]:
    index = next(i for i, h in enumerate(table[0]) if header_part in h)
    return {row[0]: row[index] for row in table[1:]}


# --------------------------------------------------------------------------- tables show what was stored


STORED_VLLM = {"ttft.p50": 0.0123, "ttft.p99": 0.0456, "tpot.p50": 0.00512, "itl.p99": 0.00934,
               "e2e.p50": 0.0789, "e2e.p99": 0.1234, "output_token_throughput": 1234.5, "goodput": 55.5,
               "rejection_rate": 0.0, "mean_decoding": 3.4321}
STORED_HF = {"ttft.p50": 0.2345, "ttft.p99": 0.9876, "tpot.p50": 0.0211, "itl.p99": 0.0432,
             "e2e.p50": 0.3456, "e2e.p99": 1.5432, "output_token_throughput": 321.0, "goodput": 12.25,
             "rejection_rate": 0.125, "mean_decoding": None}


@pytest.fixture
def two_engines(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    write_run(results, engine="vllm", stored=STORED_VLLM, preempt_step=1.0, peak_kv=0.6)
    write_run(results, engine="hf-static", batching=BatchingConfig("static", max_batch_size=4), failed=3,
              stored=STORED_HF, peak_kv=None,
              engine_report={"prompt_pad_fraction": 0.4321, "decode_idle_fraction": 0.1, "batches": []})
    return results


def test_markdown_table_shows_each_engines_stored_figures(two_engines: Path, tmp_path: Path) -> None:
    _, warnings = build_quiet(two_engines, tmp_path / "out")
    assert warnings == []
    md = (tmp_path / "out" / "report.md").read_text()
    table = md_table_after(md, "## Workload: chat")
    vllm = column(table, "vllm [continuous-bs4]")
    hf = column(table, "hf-static [static-bs4]")
    assert vllm["TTFT p50 (ms)"] == "12.3" and hf["TTFT p50 (ms)"] == "234"
    assert vllm["TTFT p99 (ms)"] == "45.6" and hf["TTFT p99 (ms)"] == "988"
    assert vllm["TPOT p50 (ms)"] == "5.12" and hf["TPOT p50 (ms)"] == "21.1"
    assert vllm["ITL p99 (ms)"] == "9.34" and hf["ITL p99 (ms)"] == "43.2"
    assert vllm["E2E p50 (ms)"] == "78.9" and hf["E2E p50 (ms)"] == "346"
    assert vllm["E2E p99 (ms)"] == "123" and hf["E2E p99 (ms)"] == "1543"
    assert vllm["Output tok/s"] == "1234.5" and hf["Output tok/s"] == "321.0"
    assert vllm["Goodput (req/s)"] == "55.5" and hf["Goodput (req/s)"] == "12.2"
    assert vllm["Rejection rate"] == "0.0%" and hf["Rejection rate"] == "12.5%"
    assert vllm["Requests ok / failed"] == "24 / 0" and hf["Requests ok / failed"] == "21 / 3"
    assert hf["Failures by kind"] == "rejected: 3"
    assert vllm["Prompt pad fraction"] == "n/a" and hf["Prompt pad fraction"] == "43.2%"
    # the stored client-side occupancy; a document from before it was stored shows n/a
    assert vllm["Mean requests decoding"] == "3.43" and hf["Mean requests decoding"] == "n/a"
    # derived from the samples: KV peak, the counter's increase during the run (not its lifetime value)
    assert vllm["Peak KV usage"] == "60.0%" and hf["Peak KV usage"] == "n/a"
    assert vllm["Preemptions (during run)"] == "19" and hf["Preemptions (during run)"] == "0"
    assert vllm["Max waiting"] == "3"
    assert vllm["Status"] == hf["Status"] == "complete"
    assert "danger zone" not in md
    # the machine-readable rows carry the stored numbers unrounded
    rows = {r["engine"]: r for r in json.loads((tmp_path / "out" / "report.json").read_text())["runs"]}
    for key, dotted in (("ttft_p50", "ttft.p50"), ("e2e_p99", "e2e.p99"), ("goodput", "goodput")):
        assert rows["vllm"]["metrics"][key] == STORED_VLLM[dotted]
        assert rows["hf-static"]["metrics"][key] == STORED_HF[dotted]
    assert rows["vllm"]["batching_label"] == "continuous-bs4"
    assert rows["vllm"]["workload"] == {"name": "chat", "hash": chat_workload(4).hash()}
    assert rows["vllm"]["summary_source"] == "document"
    # the environment section names the machine, and the CPU placement (these documents predate it)
    assert "bench-01" in md and "## Environment" in md
    assert "| cpu placement | not recorded |" in md


def test_ttft_by_bucket_table_uses_the_harness_buckets(two_engines: Path, tmp_path: Path) -> None:
    build_quiet(two_engines, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    table = md_table_after(md, "### TTFT by batch-size bucket")
    assert table[0][1:] == ["in flight 1", "in flight 2-3", "in flight 4-7", "in flight 8-15", "in flight 16+"]
    row = next(r for r in table if r[0].startswith("vllm"))
    records = make_records(chat_workload(4), ttft=0.02, tpot=0.005, concurrency=4)
    expected = ttft_by_bucket(records, lambda r: r.in_flight_at_send, (1, 2, 4, 8, 16))
    one, two3, four7 = expected["1"], expected["2-3"], expected["4-7"]
    assert one is not None and two3 is not None and four7 is not None
    assert row[1] == f"{one.p50 * 1000:.1f} / {one.p99 * 1000:.1f} (n=6)"
    assert row[2].endswith("(n=12)") and row[3].endswith("(n=6)")
    assert row[4] == row[5] == "—"


def test_batchbench_report_cli(two_engines: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli-out"
    proc = subprocess.run([sys.executable, "-m", "batchbench", "report", str(two_engines), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in out.iterdir()} == {"report.json", "report.md", "report.html"}
    # the batchbench CLI's entry point: build(results_dir, out_dir) -> the folder written
    assert build(two_engines, tmp_path / "again") == tmp_path / "again"


# --------------------------------------------------------------------------- KV danger zone


@pytest.mark.parametrize(("peak", "flagged"), [(0.5, False), (0.8499, False), (0.85, True), (0.97, True)])
def test_danger_zone_flag_exactly_when_a_sample_reaches_085(tmp_path: Path, peak: float, flagged: bool) -> None:
    results = tmp_path / "results"
    write_run(results, engine="vllm", peak_kv=peak)
    write_run(results, engine="tgi", peak_kv=0.3)
    build_quiet(results, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    html = (tmp_path / "out" / "report.html").read_text()
    assert ("danger zone" in md) is flagged
    assert ("danger zone" in html) is flagged
    peak_row = column(md_table_after(md, "## Workload: chat"), "vllm")["Peak KV usage"]
    assert peak_row == (f"⚠ {peak * 100:.1f}% (danger zone)" if flagged else f"{peak * 100:.1f}%")
    rows = {r["engine"]: r for r in json.loads((tmp_path / "out" / "report.json").read_text())["runs"]}
    assert rows["vllm"]["server"]["danger_zone"] is flagged
    assert rows["vllm"]["server"]["kv_usage_peak"] == pytest.approx(peak)
    assert rows["tgi"]["server"]["danger_zone"] is False


def test_a_measurements_repeats_in_the_danger_zone_are_one_line_without_its_bookkeeping(tmp_path: Path) -> None:
    results = tmp_path / "results"
    for i, peak in enumerate((0.95, 0.5, 0.99)):
        write_run(results, engine="vllm", peak_kv=peak, name=f"vllm_r{i}",
                  labels={"concurrency": 4, "repeat": i, "suite": "main", "design": {"fit": 8}, "precision": 0.05})
    build_quiet(results, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    overview = md[md.index("## Overview"):md.index("## Workload")]
    (line,) = [text for text in overview.splitlines() if "danger zone" in text]
    assert "vllm \\[continuous-bs4\\] concurrency=4 (chat) entered the KV danger zone in 2 of 3 runs: peak KV " \
           "usage 99.0%" in line
    assert "design" not in line and "precision" not in line and "suite" not in line


# --------------------------------------------------------------------------- baseline comparison


def _baseline_pair(tmp_path: Path, factor: dict[str, float]) -> tuple[Path, Path]:
    """Baseline and current folders: per engine, the current TTFT p99 is the baseline's times ``factor``."""
    before, after = tmp_path / "before", tmp_path / "after"
    for engine, f in factor.items():
        base = {"ttft.p99": 0.100, "output_token_throughput": 1000.0}
        write_run(before, engine=engine, stored=base)
        write_run(after, engine=engine, stored={"ttft.p99": 0.100 * f, "output_token_throughput": 1000.0})
    return before, after


def _deltas(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["engine"]: {d["metric"]: d for d in m["deltas"]} for m in report["comparisons"]["baseline"]["matches"]}


def test_baseline_flags_a_20pct_ttft_regression_and_not_a_5pct_one(tmp_path: Path) -> None:
    before, after = _baseline_pair(tmp_path, {"vllm": 1.20, "tgi": 1.05, "trtllm": 0.70})
    result, _ = build_quiet(after, tmp_path / "out", baseline=before)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    deltas = _deltas(report)
    assert deltas["vllm"]["ttft_p99"]["pct"] == pytest.approx(20.0)
    assert deltas["vllm"]["ttft_p99"]["regression"] is True
    assert deltas["tgi"]["ttft_p99"]["pct"] == pytest.approx(5.0)
    assert deltas["tgi"]["ttft_p99"]["regression"] is False
    assert deltas["trtllm"]["ttft_p99"]["regression"] is False  # 30% faster is an improvement
    assert deltas["trtllm"]["ttft_p99"]["improvement"] is True
    assert result.regressions == report["comparisons"]["baseline"]["regressions"] == 1
    md = (tmp_path / "out" / "report.md").read_text()
    table = md_table_after(md, "## Comparison with baseline")
    ttft = column(table, "TTFT p99")
    by_engine = {name.split(" ")[0]: cell for name, cell in ttft.items()}
    assert by_engine["vllm"] == "+20.0% REGRESSION"
    assert by_engine["tgi"] == "+5.0%"
    assert by_engine["trtllm"] == "-30.0% improved"
    assert md.count("REGRESSION") == 1


def test_baseline_can_be_an_earlier_report_json_and_the_cli_can_gate_on_it(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    before, after = _baseline_pair(tmp_path, {"vllm": 1.20})
    build_quiet(before, tmp_path / "before-report")
    earlier = tmp_path / "before-report" / "report.json"
    code = main(["report", str(after), "--out", str(tmp_path / "out"), "--baseline", str(earlier),
                 "--fail-on-regression", "--no-plots"])
    assert code == 1
    assert "1 regressions beyond 10%" in capsys.readouterr().out
    assert _deltas(json.loads((tmp_path / "out" / "report.json").read_text()))["vllm"]["ttft_p99"]["regression"]
    # a looser threshold lets the same change pass
    assert main(["report", str(after), "--out", str(tmp_path / "out2"), "--baseline", str(earlier),
                 "--threshold", "25", "--fail-on-regression", "--no-plots"]) == 0


@given(base=st.floats(0.001, 1e4), change=st.floats(-0.9, 3.0), threshold=st.floats(0.0, 50.0))
def test_regressions_point_the_worse_way_for_each_metric(base: float, change: float, threshold: float) -> None:
    current = base * (1 + change)
    pct = (current - base) / base * 100
    latency = delta("ttft_p99", base, current, threshold)
    throughput = delta("output_token_throughput", base, current, threshold)
    assert latency.regression == (pct > threshold)
    assert throughput.regression == (pct < -threshold)
    assert not (latency.regression and latency.improvement)


def test_rejections_appearing_from_zero_is_a_regression() -> None:
    d = delta("rejection_rate", 0.0, 0.05, 10.0)
    assert d.pct is None and d.regression
    same = delta("rejection_rate", 0.0, 0.0, 10.0)
    assert same.pct == 0.0 and not same.regression and not same.improvement


# --------------------------------------------------------------------------- repeats


def _repeated(folder: Path, engine: str, ttft_p99s: list[float]) -> None:
    """One series: the same run repeated, each repeat with its own TTFT p99."""
    for i, value in enumerate(ttft_p99s):
        write_run(folder, engine=engine, labels={"concurrency": 4, "repeat": i}, name=f"{engine}_r{i}",
                  stored={"ttft.p99": value, "output_token_throughput": 1000.0 + i})


def noise_and_regression(a: Path, b: Path) -> None:
    """Two series measured at A and B: vllm 10% worse at B, but A's repeats spread wide (noise); tgi worse beyond
    any doubt (a regression)."""
    _repeated(a, "vllm", [0.100, 0.110, 0.200])
    _repeated(a, "tgi", [0.100, 0.110, 0.120])
    _repeated(b, "vllm", [0.150, 0.140, 0.160])
    _repeated(b, "tgi", [0.250, 0.260, 0.240])


def test_repeats_are_summarised_as_the_mean_and_its_interval(tmp_path: Path) -> None:
    _repeated(tmp_path / "results", "vllm", [0.100, 0.300, 0.120])
    write_run(tmp_path / "results", engine="tgi", name="tgi_once")  # not repeated: no column
    build_quiet(tmp_path / "results", tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    table = md_table_after(md, "### Across repeats")
    assert len(table[0]) == 2  # the metric names and the one repeated series
    vllm = column(table, "vllm [continuous-bs4] concurrency=4")
    assert vllm["Repeats"] == "3"
    ttft, tok = Estimate.of([0.100, 0.300, 0.120]), Estimate.of([1000.0, 1001.0, 1002.0])
    # On the log scale: the spread of a latency cannot take its mean to 0.
    assert vllm["TTFT p99 (ms)"] == f"{ttft.value * 1000:.0f} [{ttft.low * 1000:.1f}–{ttft.high * 1000:.0f}]"
    assert ttft.low > 0.03
    assert vllm["Output tok/s"] == f"1001.0 [{tok.low:.1f}–{tok.high:.1f}]"
    series = {s["engine"]: s for s in json.loads((tmp_path / "out" / "report.json").read_text())["series"]}
    assert series["vllm"]["metrics"]["ttft_p99"] == pytest.approx(ttft.value)
    assert codec.decode(Estimate, series["vllm"]["spread"]["ttft_p99"]) == ttft
    assert series["tgi"]["repeats"] == 1


def test_a_change_within_noise_is_not_a_regression(tmp_path: Path) -> None:
    # vllm's baseline repeats spread 100-200 ms: a new mean of 150 ms is 10% worse and its interval against the
    # baseline's contains 1: noise. tgi's baseline is tight at 110 ms, and 250 ms is beyond any doubt: flagged.
    _repeated(tmp_path / "before", "vllm", [0.100, 0.110, 0.200])
    _repeated(tmp_path / "before", "tgi", [0.100, 0.110, 0.120])
    _repeated(tmp_path / "after", "vllm", [0.150, 0.140, 0.160])
    _repeated(tmp_path / "after", "tgi", [0.250, 0.260, 0.240])
    result, _ = build_quiet(tmp_path / "after", tmp_path / "out", baseline=tmp_path / "before")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    deltas = _deltas(report)
    assert deltas["vllm"]["ttft_p99"]["pct"] == pytest.approx(100 * (0.150 - 0.41 / 3) / (0.41 / 3))
    assert deltas["vllm"]["ttft_p99"]["regression"] is False
    assert deltas["tgi"]["ttft_p99"]["regression"] is True
    assert result.regressions == 1
    matches = report["comparisons"]["baseline"]["matches"]
    assert [(m["repeats"], m["baseline_repeats"]) for m in matches] == [(3, 3), (3, 3)]
    assert all(m["labels"] == {"concurrency": 4} for m in matches)  # one series each, the repeat number aside
    assert "mean of 3 runs against the mean of 3 baseline runs" in (tmp_path / "out" / "report.md").read_text()


@given(st.lists(st.floats(0.01, 100.0), min_size=2, max_size=5), st.floats(0.01, 100.0), st.floats(0.0, 50.0))
def test_a_single_run_regresses_only_outside_the_baselines_interval(repeats: list[float], current: float,
                                                                    threshold: float) -> None:
    base = Estimate.of(repeats)
    assert base is not None and base.low is not None and base.high is not None
    pct = (current - base.value) / base.value * 100
    latency = delta("ttft_p99", base.value, current, threshold, base)
    throughput = delta("output_token_throughput", base.value, current, threshold, base)
    assert latency.regression == (pct > threshold and current > base.high)
    assert throughput.regression == (pct < -threshold and current < base.low)
    assert latency.improvement == (pct < -threshold and current < base.low)


@given(st.lists(st.floats(0.01, 100.0), min_size=2, max_size=5), st.lists(st.floats(0.01, 100.0), min_size=2,
                                                                         max_size=5), st.floats(0.0, 50.0))
def test_repeated_sides_regress_only_when_their_ratio_excludes_one(base: list[float], now: list[float],
                                                                   threshold: float) -> None:
    a, b = Estimate.of(base), Estimate.of(now)
    assert a is not None and b is not None
    ratio = b.ratio(a)
    assert ratio is not None
    pct = (b.value - a.value) / a.value * 100
    found = delta("ttft_p99", a.value, b.value, threshold, a, b)
    assert found.regression == (pct > threshold and bool(ratio.differs_from_one))


# --------------------------------------------------------------------------- bad input


def test_malformed_files_are_skipped_with_a_warning_naming_them(two_engines: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    (two_engines / "torn.json").write_text('{"schema": "batchbench.results", "engine": {"engi')
    no_engine = json.loads(next(two_engines.glob("vllm*.json")).read_text())
    del no_engine["engine"]
    (two_engines / "sub").mkdir()
    (two_engines / "sub" / "no-engine.json").write_text(json.dumps(no_engine))
    newer = copy.deepcopy(no_engine) | {"schema_version": 99}
    (two_engines / "newer.json").write_text(json.dumps(newer))
    (two_engines / "binary.json").write_bytes(b"\xff\xfe\x00garbage")
    # pytest-benchmark output and a stray log are not batchbench files: ignored, no warning
    (two_engines / "benchmark.json").write_text(json.dumps({"machine_info": {}, "benchmarks": []}))
    (two_engines / "events.jsonl").write_text('{"event": "started"}\n')

    code = main(["report", str(two_engines), "--out", str(tmp_path / "out"), "--no-plots"])
    err = capsys.readouterr().err
    assert code == 0
    for name in ("torn.json", "sub/no-engine.json", "newer.json", "binary.json"):
        assert re.search(rf"warning: {re.escape(name)}: skipped", err), err
    assert "benchmark.json" not in err and "events.jsonl" not in err
    assert "Traceback" not in err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert {r["engine"] for r in report["runs"]} == {"vllm", "hf-static"}
    assert len(report["warnings"]) == 4
    assert sorted(report["ignored_files"]) == ["benchmark.json", "events.jsonl"]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Skipped files" in md and "torn.json" in md
    for name in ("report.md", "report.json", "report.html"):  # files are named relatively, never by machine path
        assert str(tmp_path) not in (tmp_path / "out" / name).read_text()


def test_a_journal_only_run_appears_marked_partial(two_engines: Path, tmp_path: Path) -> None:
    journal = write_run(two_engines, engine="tgi", finish=False)
    assert journal.suffix == ".jsonl" and not journal.with_suffix(".json").exists()
    build_quiet(two_engines, tmp_path / "out")
    rows = {r["engine"]: r for r in json.loads((tmp_path / "out" / "report.json").read_text())["runs"]}
    tgi = rows["tgi"]
    assert tgi["status"] == "partial" and rows["vllm"]["status"] == "complete"
    # no footer, so no stored summary: the harness's summarize over the journal's records
    assert tgi["summary_source"] == "derived"
    records = make_records(chat_workload(4), ttft=0.02, tpot=0.005, concurrency=4)
    expected = summarize(records, duration_s=max(max(r.done_s or 0 for r in records), 19 * 0.25))
    assert tgi["ok"] == 24
    assert tgi["metrics"]["ttft_p50"] == pytest.approx(expected.ttft.p50 if expected.ttft else None)
    md = (tmp_path / "out" / "report.md").read_text()
    status = column(md_table_after(md, "## Workload: chat"), "tgi")["Status"]
    assert status == "⚠ PARTIAL (summary from journal)"
    assert "⚠ PARTIAL: tgi" in md  # and called out in the overview
    html = (tmp_path / "out" / "report.html").read_text()
    assert "⚠ PARTIAL" in html


def test_an_interrupted_run_is_marked_with_its_reason(two_engines: Path, tmp_path: Path) -> None:
    path = write_run(two_engines, engine="tgi")
    doc = json.loads(path.read_text())
    doc.update(status="interrupted", error="CancelledError: Ctrl-C")
    path.write_text(json.dumps(doc))
    build_quiet(two_engines, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert column(md_table_after(md, "## Workload: chat"), "tgi")["Status"] == "⚠ INTERRUPTED"
    assert "the run was interrupted (CancelledError: Ctrl-C)" in md


def test_a_finished_document_supersedes_its_leftover_journal(two_engines: Path, tmp_path: Path) -> None:
    path = next(two_engines.glob("vllm*.json"))
    path.with_suffix(".jsonl").write_text(path.read_text().replace("\n", " ") + "\n")
    result, warnings = build_quiet(two_engines, tmp_path / "out")
    assert warnings == [] and len(result.inputs.runs) == 2


@pytest.mark.parametrize("contents", [{}, {"benchmark.json": json.dumps({"benchmarks": []})}])
def test_nothing_to_report_is_a_clear_error_exit(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 contents: dict[str, str]) -> None:
    results = tmp_path / "results"
    results.mkdir()
    for name, text in contents.items():
        (results / name).write_text(text)
    code = main(["report", str(results), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert "batchbench: no batchbench results documents found under" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out" / "report.md").exists()


def test_missing_results_folder_and_missing_baseline_are_clear_errors(two_engines: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "nope"), "--out", str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["report", str(two_engines), "--out", str(tmp_path / "out"), "--baseline",
                 str(tmp_path / "gone")]) == 2
    assert "baseline" in capsys.readouterr().err


# --------------------------------------------------------------------------- HTML


EVIL = '<script>alert("pwned")</script>'


class Tags(HTMLParser):
    """Every start tag of a page with its attributes, as a browser would parse them."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, list[tuple[str, str | None]]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.seen.append((tag, attrs))


def test_html_is_self_contained_and_escapes_strings_from_results(tmp_path: Path) -> None:
    results = tmp_path / "results"
    write_run(results, engine=EVIL, labels={"concurrency": 4, "note": '<img src="//evil.example/x.png">'},
              peak_kv=0.9, name="evil")
    write_run(results, engine="vllm", peak_kv=0.4)
    write_run(results, engine="vllm", concurrency=8, peak_kv=0.7)
    build_quiet(results, tmp_path / "out", plots=True)
    html = (tmp_path / "out" / "report.html").read_text()
    assert "<script" not in html and EVIL not in html
    assert "&lt;script&gt;alert(&quot;pwned&quot;)&lt;/script&gt;" in html
    assert "http://" not in html and "https://" not in html
    assert "<link" not in html and "@import" not in html
    assert re.findall(r"url\((.)", html) == re.findall(r"url\((#)", html)  # a figure's clip paths, on the page
    tags = Tags()
    tags.feed(html)
    assert not {"script", "link", "iframe", "object", "embed", "img", "image", "foreignobject"} & \
        {tag for tag, _ in tags.seen}
    assert not [name for _, attrs in tags.seen for name, _ in attrs if name == "src" or name.startswith("on")]
    # every figure is inline SVG: the latency-throughput figures of the findings and one per workload
    assert html.count("<svg ") >= 4
    assert all((value or "").startswith("#") for _, attrs in tags.seen for name, value in attrs if name == "href")
    assert "&lt;img src=&quot;//evil.example/x.png&quot;&gt;" in html
    # the engine's name inside a figure (a legend) is text, escaped as the SVG's serialiser escapes it
    assert '&lt;script&gt;alert("pwned")&lt;/script&gt;' in html.split("<svg ", 1)[1]
    md = (tmp_path / "out" / "report.md").read_text()
    assert re.search(r"(?<!\\)<", md) is None  # every < from the results is backslash-escaped


def test_markdown_escaping_keeps_tables_intact() -> None:
    assert md_escape("a|b\nc") == "a\\|b c"
    assert md_escape("<b>x</b>") == "\\<b\\>x\\</b\\>"
    assert md_escape("run_id_1") == "run_id_1"


def test_guardrails_are_the_stored_ones_and_computed_only_for_a_partial_run(tmp_path: Path) -> None:
    results = tmp_path / "results"
    path = write_run(results, engine="vllm", peak_kv=0.5)
    doc = json.loads(path.read_text())
    doc["guardrails"] |= {"kv_usage_peak": 0.95, "kv_danger_samples": 2, "waiting_peak": 42.0}
    path.write_text(json.dumps(doc))
    write_run(results, engine="tgi", peak_kv=0.9, finish=False)  # journal only: no stored guardrails
    build_quiet(results, tmp_path / "out")
    rows = {r["engine"]: r for r in json.loads((tmp_path / "out" / "report.json").read_text())["runs"]}
    assert rows["vllm"]["server"]["kv_usage_peak"] == 0.95 and rows["vllm"]["server"]["danger_zone"] is True
    assert rows["vllm"]["server"]["waiting_peak"] == 42.0  # the samples say 3: the stored figure wins
    expected = server_summary(make_samples(peak_kv=0.9))
    assert rows["tgi"]["status"] == "partial"
    assert rows["tgi"]["server"]["kv_usage_peak"] == pytest.approx(expected.kv_usage_peak)
    assert rows["tgi"]["server"]["danger_zone"] is True and rows["tgi"]["server"]["waiting_peak"] == 3


def test_a_report_that_cannot_be_written_whole_leaves_the_previous_one(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from batchbench.reports import build as build_module

    old = {"report.json": "{}\n", "report.md": "# old\n", "report.html": "<p>old</p>"}
    build_module._write_all(tmp_path, old)
    real_write = Path.write_text

    def disk_full(self: Path, text: str, *args: object, **kwargs: object) -> int:
        if self.name == ".report.html.tmp":
            real_write(self, text[: len(text) // 2], encoding="utf-8")
            raise OSError(28, "No space left on device")
        return real_write(self, text, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError, match="No space left"):
        build_module._write_all(tmp_path, {"report.json": '{"new": 1}\n', "report.md": "# new\n",
                                           "report.html": "<p>new</p>" * 100})
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == old


def test_a_sessions_undecided_and_failed_claims_are_listed_with_their_intervals(two_engines: Path,
                                                                                  tmp_path: Path) -> None:
    claims = [Claim("suites/test_a.py::test_x[vllm]", "continuous/static at 8: x1.04 [0.93-1.16] (n=6), "
                    "expected above 1.1", "undecided"),
              Claim("suites/test_b.py::test_y[vllm]", "budget/cap: x2.1 [1.9-2.3] (n=3), expected above 1.2", "held"),
              Claim("suites/test_c.py::test_z[vllm]", "TPOT speedup: needs a GPU", "not made")]
    write_claims(two_engines, claims)
    _, warnings = build_quiet(two_engines, tmp_path / "out")
    assert warnings == []
    md = (tmp_path / "out" / "report.md").read_text()
    table = md_table_after(md, "## Claims")
    assert [row[0] for row in table[1:]] == ["undecided", "not made", "held"]
    assert "x1.04 [0.93-1.16] (n=6), expected above 1.1" in table[1][2]
    assert "1 held, 0 failed, 1 undecided" in md and "1 not made on this hardware" in md
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [c["outcome"] for c in report["claims"]] == ["undecided", "held", "not made"]
    assert report["ignored_files"] == []  # the claims file is the session's, not a foreign file
    assert read_claims(tmp_path) == []  # a folder without one: none


def test_a_folder_without_claims_has_no_claims_section(two_engines: Path, tmp_path: Path) -> None:
    build_quiet(two_engines, tmp_path / "out")
    assert "## Claims" not in (tmp_path / "out" / "report.md").read_text()


def test_the_main_jobs_greedy_answers_are_compared_pair_by_pair(two_engines: Path, tmp_path: Path) -> None:
    write_greedy(two_engines, [
        GreedyOutputs("hf-static", "seeded (seed 0), bfloat16", "k", ((1, 2, 3, 4), (5, 6, 7, 8))),
        GreedyOutputs("vllm", "vLLM's dummy weights (--load-format dummy)", None, ((9, 9, 9, 9), (9, 9, 9, 9))),
        GreedyOutputs("llamacpp", "seeded bf16, widened to f32 in a GGUF", "k", ((1, 2, 3, 4), (5, 6, 0, 0))),
    ])
    _, warnings = build_quiet(two_engines, tmp_path / "out")
    assert warnings == []
    md = (tmp_path / "out" / "report.md").read_text()
    table = md_table_after(md, "## Greedy agreement")
    assert table[1][0] == "hf-static / llamacpp" and table[1][2:] == ["75% (6 of 8)", "1 of 2", "token 3"]
    assert "vllm: vLLM's dummy weights (--load-format dummy): compared with no other engine" in md
    (pair,) = json.loads((tmp_path / "out" / "report.json").read_text())["greedy_agreement"]
    assert pair["engines"] == ["hf-static", "llamacpp"] and pair["tokens_agree"] == 6


def test_how_it_was_measured_is_one_block_with_the_command_that_reproduces_it(tmp_path: Path) -> None:
    results = tmp_path / "results"
    write_run(results, engine="vllm")
    (doc_path,) = results.glob("*.json")
    doc = json.loads(doc_path.read_text())
    doc["environment"] = {**doc["environment"], "command": "batchbench run --api-key '***' --engine vllm",
                          "cpu_quota": "1.0 CPU (cgroup v2)"}
    doc_path.write_text(json.dumps(doc))
    build_quiet(results, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    rows = {row[0]: row[1] for row in md_table_after(md, "## How this was measured")[1:]}
    assert rows["Command"] == "batchbench run --api-key '***' --engine vllm"
    assert rows["CPU quota"] == "1.0 CPU (cgroup v2)"
    assert rows["Engine vllm"].startswith("1.0: ") or "vllm 1.0" in rows["Engine vllm"]
    assert {"Hardware", "Placement", "batchbench", "Workloads"} <= rows.keys()
    assert md.index("## How this was measured") < md.index("## Environment")


def test_the_kv_cache_filled_by_the_sweeps_design_is_evidence_not_an_alarm(tmp_path: Path) -> None:
    results = tmp_path / "results"
    main = {"suite": "main", "layout": "continuous", "kv_fit": 8}
    write_run(results, engine="vllm", concurrency=16, peak_kv=0.99, labels={**main, "concurrency": 16}, name="fit16")
    write_run(results, engine="vllm", concurrency=4, peak_kv=0.99, labels={**main, "concurrency": 4}, name="under4")
    build_quiet(results, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    overview = md[md.index("## Overview"):md.index("## How this was measured")]
    assert "As designed, the sweep filled the KV cache at and past its fit (vllm at batch 16; peak 99.0%)" in overview
    # Below the fit nobody asked for a full cache: that one stays an alarm.
    (alarm,) = [line for line in overview.splitlines() if line.startswith("- ⚠")]
    assert "concurrency=4" in alarm and "entered the KV danger zone" in alarm


def test_compare_names_what_differs_between_the_two_environments(tmp_path: Path) -> None:
    here, there = tmp_path / "here", tmp_path / "there"
    write_run(here, engine="vllm")
    write_run(there, engine="vllm")
    (mine,) = here.glob("*.json")
    doc = json.loads(mine.read_text())
    doc["environment"]["cpu_quota"] = None  # recorded: no quota
    mine.write_text(json.dumps(doc))
    (path,) = there.glob("*.json")
    doc = json.loads(path.read_text())
    doc["environment"] = {**doc["environment"], "hostname": "gpu-07", "cpu_quota": "a CPU quota of 0.5 CPUs",
                          "gpus": [{"name": "NVIDIA H200"}], "packages": {"batchbench": "0.2.0", "vllm": "0.32.0"}}
    path.write_text(json.dumps(doc))
    done = subprocess.run([sys.executable, "-m", "batchbench", "compare", str(here), str(there), "--json"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["environment_differences"] == [
        "hostname: bench-01 -> gpu-07", "gpus: none -> NVIDIA H200", "cpu_quota: none -> a CPU quota of 0.5 CPUs",
        "batchbench: 0.1.0 -> 0.2.0", "vllm: absent -> 0.32.0"]
    same = subprocess.run([sys.executable, "-m", "batchbench", "compare", str(here), str(here)],
                          capture_output=True, text=True, check=False)
    assert "different environments" not in same.stdout
