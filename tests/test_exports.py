"""Machine-readable outputs: ``report --format csv|md|json``, ``report --records-csv`` and ``compare --json``."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from batchbench.analysis.repeats import Estimate
from batchbench.cli import main
from batchbench.reports.model import KEY_METRICS
from batchbench.results.document import RunDocument
from tests.test_reports import STORED_HF, STORED_VLLM, md_table_after, noise_and_regression, two_engines  # noqa: F401

#: The key metrics' stored fields (summary paths), by CSV column.
STORED_FIELD = {"ttft_p50_s": "ttft.p50", "ttft_p99_s": "ttft.p99", "tpot_p50_s": "tpot.p50",
                "itl_p99_s": "itl.p99", "e2e_p50_s": "e2e.p50", "e2e_p99_s": "e2e.p99",
                "output_token_throughput": "output_token_throughput", "goodput": "goodput",
                "rejection_rate": "rejection_rate"}


def _csv(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(path.read_text())))


def test_report_csv_has_a_row_per_run_with_the_tables_figures_unrounded(two_engines: Path,  # noqa: F811
                                                                        tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["report", str(two_engines), "--out", str(out), "--format", "csv"]) == 0
    assert {p.name for p in out.iterdir()} == {"report.csv"}  # the format asked for, alone
    rows = _csv(out / "report.csv")
    assert main(["report", str(two_engines), "--out", str(tmp_path / "md"), "--format", "md", "--no-plots"]) == 0
    table = md_table_after((tmp_path / "md" / "report.md").read_text(), "## Workload: chat")
    # The same runs as the per-run table's columns, in its order.
    assert [f"{r['engine']} [{r['batching']}] concurrency={r['label_concurrency']}" for r in rows] == table[0][1:]
    by_engine = {r["engine"]: r for r in rows}
    for engine, stored in (("vllm", STORED_VLLM), ("hf-static", STORED_HF)):
        row = by_engine[engine]
        for col, dotted in STORED_FIELD.items():
            assert float(row[col]) == stored[dotted], (engine, col)
    assert {f"{spec.key}" for spec in KEY_METRICS} <= {c.removesuffix("_s") for c in rows[0]}
    hf, vllm = by_engine["hf-static"], by_engine["vllm"]
    assert (hf["requests"], hf["ok"], hf["failed"]) == ("24", "21", "3")
    assert json.loads(hf["failures"]) == {"rejected": 3} and vllm["failures"] == ""
    assert hf["prompt_pad_fraction"] == "0.4321" and vllm["prompt_pad_fraction"] == ""  # n/a is an empty cell
    assert float(vllm["kv_usage_peak"]) == 0.6 and hf["kv_usage_peak"] == ""
    assert vllm["preemptions"] == "19.0" and vllm["status"] == "complete" and vllm["kv_danger_zone"] == "False"


@pytest.mark.parametrize(("fmt", "files"), [("json", {"report.json"}), ("md", {"report.md"}),
                                            ("html", {"report.html", "report.md", "report.json"})])
def test_each_format_writes_its_file_and_html_stays_the_whole_report(
        two_engines: Path, tmp_path: Path, fmt: str, files: set[str]) -> None:  # noqa: F811
    out = tmp_path / "out"
    assert main(["report", str(two_engines), "--out", str(out), "--format", fmt, "--no-plots"]) == 0
    assert {p.name for p in out.iterdir()} == files


def test_records_csv_has_every_request_of_every_run(two_engines: Path, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "out"
    assert main(["report", str(two_engines), "--out", str(out), "--format", "csv", "--records-csv"]) == 0
    rows = _csv(out / "records.csv")
    docs = {p.stem: RunDocument.load(p) for p in two_engines.glob("*.json")}
    assert len(rows) == sum(len(d.records) for d in docs.values()) == 48
    for row in rows:
        record = next(r for r in docs[row["run_id"]].records if r.request_id == row["request_id"])
        assert row["ok"] == str(record.ok) and row["error_kind"] == (record.error_kind or "")
        assert float(row["scheduled_s"]) == record.scheduled_s and int(row["output_tokens"]) == record.output_tokens
        if record.ok:
            assert record.ttft_s is not None and float(row["ttft_s"]) == pytest.approx(record.ttft_s, abs=1e-12)
        else:
            assert row["ttft_s"] == "" and row["error"] == "HTTP 429"
    assert sum(row["ok"] == "False" for row in rows) == 3


def test_compare_json_has_the_tables_rows_with_their_verdicts(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    noise_and_regression(tmp_path / "a", tmp_path / "b")
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    table = capsys.readouterr().out
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)  # stdout is the JSON document alone
    assert doc["regressions"] == 1 and doc["threshold_pct"] == 10.0
    series = {s["engine"]: s for s in doc["series"]}
    assert (series["vllm"]["a_repeats"], series["vllm"]["b_repeats"]) == (3, 3)
    ttft = {e: next(m for m in s["metrics"] if m["metric"] == "ttft_p99") for e, s in series.items()}
    assert ttft["vllm"]["verdict"] == "within noise" and ttft["tgi"]["verdict"] == "REGRESSION"
    assert ttft["vllm"]["a"] == pytest.approx((0.100 + 0.110 + 0.200) / 3) and ttft["vllm"]["b"] == pytest.approx(0.15)
    assert ttft["vllm"]["change_pct"] == pytest.approx(9.756, abs=0.01)
    low, high = ttft["vllm"]["b_interval"]
    b = Estimate.of([0.150, 0.140, 0.160])  # B's mean with its interval (on the log scale), as the table shows it
    assert b is not None and (low, high) == (pytest.approx(b.low), pytest.approx(b.high))
    # Every line of the table is a row here, with the same verdict.
    lines = [line for line in table.splitlines() if line.startswith("  ")]
    rows = [m for s in doc["series"] for m in s["metrics"]]
    assert len(lines) == len(rows) and [line.split()[-1] for line in lines] == [m["verdict"].split()[-1]
                                                                               for m in rows]
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json", "--fail-on-regression"]) == 1
