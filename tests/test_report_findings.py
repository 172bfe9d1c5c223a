"""The report leads with the answer: a findings dict in, the first screen of report.md and report.html out.

The findings are given as a dict of ``Findings.to_dict()``'s shape (``FINDINGS``), so the report is tested
without ``batchbench.findings``; the runs they cite are written with the harness's own writer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from batchbench.adapters.base import BatchingConfig
from batchbench.cli import main
from batchbench.reports.build import build_report
from tests.test_reports import _repeated, column, md_table_after, write_run

#: Where a figure starts in a page, whatever it is drawn as (inline SVG, an image, a figure element).
FIGURE = re.compile(r"<(?:svg|img|figure)[\s>]")


def first_figure(html: str) -> int:
    """The position of the page's first figure (the end of the page when it has none)."""
    found = FIGURE.search(html)
    return found.start() if found else len(html)


def iv(median: float, low: float, high: float, n: int = 3) -> dict[str, Any]:
    return {"median": median, "low": low, "high": high, "n": n, "method": "repeats"}


def point(c: int, tok: float, ttft: float, regime: str, run_ids: list[str], **extra: Any) -> dict[str, Any]:
    return {"concurrency": c, "output_tok_s": iv(tok, tok * 0.9, tok * 1.1), "ttft_p99_s": iv(ttft, ttft * 0.8, ttft),
            "ttft_p50_s": iv(ttft / 2, ttft / 3, ttft / 2), "tpot_p50_s": iv(0.005, 0.004, 0.006),
            "goodput_req_s": iv(5.0, 4.0, 6.0), "meets_slo": ttft <= 0.2, "regime": regime, "valid": True,
            "invalid_reasons": [], "kv_usage_peak": 0.5, "preemptions": 0.0, "mean_decoding": iv(c * 0.9, c * 0.8, c),
            "run_ids": run_ids} | extra


FINDINGS: dict[str, Any] = {
    "slo": {"ttft_p99": 0.2},
    "sentences": ["vllm serves 1234 tok/s at its sweet spot (c=8), 3.8x hf-static.",
                  "vllm becomes memory-bound from c=16 (KV peak 95%)."],
    "engines": {
        "vllm": {
            "continuous": {
                "points": [point(1, 300.0, 0.02, "under-utilised", ["vllm_c1"]),
                           point(8, 1234.0, 0.045, "sweet-spot", ["vllm_c8"]),
                           point(16, 1300.0, 0.31, "memory-bound", ["vllm_c16"], kv_usage_peak=0.95)],
                "sweet_spot": {"concurrency": 8, "output_tok_s": iv(1234.0, 1100.0, 1300.0),
                               "ttft_p99_s": iv(0.045, 0.040, 0.050), "evidence": ["vllm_c8"]},
                "memory_bound_from": {"concurrency": 16, "regime": "memory-bound", "kv_usage_peak": 0.95,
                                      "kv_fit_predicted": 12, "evidence": ["vllm_c16"]},
                "max_goodput_under_slo": {"concurrency": 8, "goodput_req_s": iv(5.0, 4.0, 6.0),
                                          "output_tok_s": iv(1234.0, 1100.0, 1300.0),
                                          "first_failing": {"concurrency": 16, "failed": ["ttft_p99=310ms>200ms"]},
                                          "evidence": ["vllm_c8", "vllm_c16"]},
                "continuous_over_static": {"at": {"8": {"ratio": iv(1.25, 1.1, 1.4), "mean_decoding": 7.2,
                                                        "ideal_mean_decoding": 8.0, "static_mean_decoding": 5.0}},
                                           "at_sweet_spot": iv(1.25, 1.1, 1.4), "within_noise": False},
                "padding_cost": None,
                "recommended": {"latency_pool_max_num_seqs": 8, "throughput_pool_concurrency": 16,
                                "why": "c=8 is the last point that meets ttft_p99<=200ms"},
            },
        },
        "hf-static": {
            "static-waves": {
                "points": [point(8, 321.0, 0.9, "saturated", ["hf_c8"]),
                           point(16, float("nan"), 0.0, "saturated", ["hf_c16"], valid=False,
                                 invalid_reasons=["3 of 24 requests failed (rejected)"])],
                "sweet_spot": None, "memory_bound_from": None, "max_goodput_under_slo": None,
                "continuous_over_static": None,
                "padding_cost": {"padded_fraction_predicted": 0.945, "latency_ratio": iv(2.1, 1.9, 2.4)},
                "recommended": {"latency_pool_max_num_seqs": None, "throughput_pool_concurrency": None, "why": ""},
            },
        },
    },
    "comparisons": [{"metric": "output_tok_s at sweet spot", "a": "vllm", "b": "hf-static",
                     "ratio": iv(3.84, 3.5, 4.1), "within_noise": False}],
    "invalid_points": [{"engine": "hf-static", "layout": "static-waves", "concurrency": 16,
                        "reasons": ["3 of 24 requests failed (rejected)"]}],
}


@pytest.fixture
def cited_runs(tmp_path: Path) -> Path:
    """The runs FINDINGS cite, by run id; the memory-bound one with KV samples to plot."""
    results = tmp_path / "results"
    for c in (1, 8, 16):
        write_run(results, engine="vllm", concurrency=c, name=f"vllm_c{c}", peak_kv=0.95 if c == 16 else 0.4)
    static = BatchingConfig("static", max_batch_size=8)
    write_run(results, engine="hf-static", batching=static, concurrency=8, name="hf_c8", peak_kv=None)
    write_run(results, engine="hf-static", batching=static, concurrency=16, name="hf_c16", failed=3, peak_kv=None)
    return results


def test_the_answer_comes_first_with_each_finding_linked_to_its_evidence(cited_runs: Path, tmp_path: Path) -> None:
    result = build_report(cited_runs, tmp_path / "out", plots=False, warn=lambda m: None, findings=FINDINGS)
    md = (tmp_path / "out" / "report.md").read_text()
    headings = re.findall(r"^## (.+)$", md, re.M)
    assert headings[:2] == ["The answer", "Overview"]
    answer = md[md.index("## The answer"):md.index("## Overview")]
    assert answer.index(FINDINGS["sentences"][0]) < answer.index("### vllm")  # the sentences lead
    vllm = column(md_table_after(md, "### vllm"), "continuous")
    assert vllm["Sweet spot"] == ("[c=8: 1234.0 [1100.0–1300.0] tok/s, TTFT p99 45.0 [40.0–50.0] ms]"
                                  "(#evidence-vllm-continuous)")
    assert "memory-bound" in vllm["Memory-bound from"] and "KV peak 95.0%" in vllm["Memory-bound from"]
    assert "predicted to fit 12 sequences" in vllm["Memory-bound from"]
    assert "fails from c=16: ttft_p99=310ms>200ms" in vllm["Max goodput under SLO"]
    assert "x1.25 [1.10–1.40] at the sweet spot" in vllm["Continuous vs static"]
    assert "within noise" not in vllm["Continuous vs static"]
    hf = column(md_table_after(md, "### hf-static"), "static-waves")
    assert "pad 94.5% (predicted), latency x2.10 [1.90–2.40]" in hf["Padding cost"]
    assert "#evidence-hf-static-static-waves" in hf["Sweet spot"]
    # each link's target is a heading whose GitHub anchor it is
    assert "## Evidence: vllm, continuous" in md and "## Evidence: hf-static, static-waves" in md
    # the invalid point, with why, on the first screen
    assert "hf-static static-waves c=16: 3 of 24 requests failed (rejected)" in answer
    assert json.loads((tmp_path / "out" / "report.json").read_text())["findings"]["sentences"] == \
        FINDINGS["sentences"]
    assert result.findings is FINDINGS


def test_html_links_resolve_and_the_answer_precedes_every_figure(cited_runs: Path, tmp_path: Path) -> None:
    build_report(cited_runs, tmp_path / "out", plots=True, warn=lambda m: None, findings=FINDINGS)
    html = (tmp_path / "out" / "report.html").read_text()
    links = set(re.findall(r'href="#([^"]+)"', html))
    ids = set(re.findall(r'id="([^"]+)"', html))
    assert {"evidence-1", "evidence-2"} <= links <= ids
    assert html.index('id="answer"') < first_figure(html)
    assert html.index("<details>") < html.index('id="answer"')  # the contents are folded away
    figures = re.findall(r'<svg [^>]*aria-label="([^"]+)"', html)
    assert any(f.startswith("Latency vs throughput: TTFT p99 and TPOT p50") for f in figures)
    assert any(f.startswith("Output tokens/s and TTFT p99 against batch size") for f in figures)
    assert any(f.startswith("Output tokens/s per accelerator") for f in figures)
    # KV timelines at the memory-bound points: vllm's finding's evidence (c=16); hf-static has no finding, so its
    # valid saturated point (c=8, not the invalid c=16); no other run
    timelines = [f.rsplit(": ", 1)[1] for f in figures
                 if f.startswith("KV usage and queue depth over time at a memory-bound point")]
    assert timelines == ["hf-static [static-bs8] concurrency=8", "vllm [continuous-bs16] concurrency=16"]


def test_findings_with_nothing_but_nulls_still_render(cited_runs: Path, tmp_path: Path) -> None:
    empty = {"slo": None, "sentences": [], "engines": {"vllm": {"continuous": {"points": []}}},
             "comparisons": [], "invalid_points": []}
    build_report(cited_runs, tmp_path / "out", plots=True, warn=lambda m: None, findings=empty)
    md = (tmp_path / "out" / "report.md").read_text()
    vllm = column(md_table_after(md, "### vllm"), "continuous")
    assert vllm["Sweet spot"].startswith("[none found]") and vllm["Max goodput under SLO"].startswith("[no SLO")
    assert "No finding could be drawn from these runs." in md


def test_a_report_built_without_findings_has_no_answer_section(cited_runs: Path, tmp_path: Path) -> None:
    result = build_report(cited_runs, tmp_path / "out", plots=False, warn=lambda m: None, findings=None)
    assert result.findings is None
    assert "## The answer" not in (tmp_path / "out" / "report.md").read_text()
    assert json.loads((tmp_path / "out" / "report.json").read_text())["findings"] is None


def test_a_run_with_failures_or_a_nan_figure_is_never_best(tmp_path: Path) -> None:
    results = tmp_path / "results"
    # hf-static has the lowest TTFT but failed requests; tgi the lowest TPOT, but its throughput is NaN
    write_run(results, engine="vllm", stored={"ttft.p50": 0.05, "tpot.p50": 0.010})
    write_run(results, engine="trtllm", stored={"ttft.p50": 0.07, "tpot.p50": 0.020})
    write_run(results, engine="hf-static", failed=2, stored={"ttft.p50": 0.01, "tpot.p50": 0.009})
    write_run(results, engine="tgi", stored={"ttft.p50": 0.06, "tpot.p50": 0.001,
                                             "output_token_throughput": float("nan")})
    build_report(results, tmp_path / "out", plots=False, warn=lambda m: None, findings=None)
    md = (tmp_path / "out" / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| TTFT p50"))
    cells = row.split("|")[2:-1]
    header = next(line for line in md.splitlines() if line.startswith("| Metric"))
    names = [h.strip() for h in header.split("|")[2:-1]]
    bold = [n for n, c in zip(names, cells) if "**" in c]
    assert bold == [n for n in names if n.startswith("vllm")]
    tpot = next(line for line in md.splitlines() if line.startswith("| TPOT p50")).split("|")[2:-1]
    assert [n for n, c in zip(names, tpot) if "**" in c] == [n for n in names if n.startswith("vllm")]
    overview = md[md.index("## Overview"):md.index("## Workload")]
    assert "- hf-static \\[continuous-bs4\\] concurrency=4 (chat): 2 of 24 requests failed: 2 rejected" in overview


def test_compare_says_per_series_and_metric_the_change_and_whether_it_is_noise(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _repeated(tmp_path / "a", "vllm", [0.100, 0.110, 0.200])
    _repeated(tmp_path / "a", "tgi", [0.100, 0.110, 0.200])
    _repeated(tmp_path / "b", "vllm", [0.150, 0.140, 0.160])  # 36% worse, but within A's repeats: noise
    _repeated(tmp_path / "b", "tgi", [0.250, 0.260, 0.240])  # worse than every A repeat: a regression
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    blocks = {b.split("\n", 1)[0].split(" ")[0]: b for b in re.split(r"\n(?=\S)", out)}
    vllm_ttft = next(line for line in blocks["vllm"].splitlines() if "TTFT p99" in line)
    assert "110 [100–200] -> 150 [140–160]" in vllm_ttft and "+36.4%" in vllm_ttft
    assert vllm_ttft.endswith("within noise")
    tgi_ttft = next(line for line in blocks["tgi"].splitlines() if "TTFT p99" in line)
    assert tgi_ttft.endswith("REGRESSION")
    assert "1 regression," in out
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--fail-on-regression"]) == 1
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "nope")]) == 2
    assert "B " in capsys.readouterr().err

