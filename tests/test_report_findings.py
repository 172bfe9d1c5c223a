"""The report leads with the answer: runs whose findings are known in, the first screen of report.md and .html out.

The runs are synthetic (``tests.synthetic_runs``): a KV-limited continuous engine swept 1..32 with static waves
and the padding pair at its fit, and a static engine with an invalid point, each repeated, so every decision has
an answer with an interval and the runs left out have a cause.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from batchbench.analysis.findings import QUESTIONS
from batchbench.cli import main
from batchbench.measures.slo import Slo
from batchbench.reports.build import build_report
from batchbench.results.document import RunDocument, RunLabels
from tests.synthetic_runs import RunSpec, document, sweep
from tests.test_reports import column, md_table_after, noise_and_regression, write_run

SLO = Slo.parse("ttft_p99=200ms")
#: Where a figure starts in a page, whatever it is drawn as (inline SVG, an image, a figure element).
FIGURE = re.compile(r"<(?:svg|img|figure)[\s>]")


def first_figure(html: str) -> int:
    """The position of the page's first figure (the end of the page when it has none)."""
    found = FIGURE.search(html)
    return found.start() if found else len(html)


def main_job_documents() -> list[RunDocument]:
    """What ``batchbench run`` leaves, in small: alpha's curve, static waves and padding pair at 8, three repeats;
    beta batches statically and one of its points failed requests."""
    docs = sweep(fit=8, repeats=3)
    for r in range(3):
        docs.append(document(RunSpec(layout="static-waves", concurrency=8, repeat=r, throughput=600 * (1 + 0.02 * r),
                                     decoding=0.5, wave=1)))
        docs.append(document(RunSpec(layout="padded-mixed", concurrency=8, repeat=r, requests=32,
                                     prompts=[1024] + [32] * 7, ttft=0.5 * (1 + 0.02 * r), wave=1)))
        docs.append(document(RunSpec(layout="homogeneous", concurrency=8, repeat=r, requests=32, prompts=[32] * 8,
                                     ttft=0.05 * (1 + 0.02 * r), wave=1)))
    docs += sweep(levels=(1, 2, 4, 8), fit=4, repeats=3, per_slot=60.0, engine="beta",
                  batching={"mode": "static", "max_batch_size": 4})
    docs.append(document(RunSpec(engine="beta", concurrency=16, failed=3, batching={"mode": "static",
                                                                                    "max_batch_size": 4})))
    return docs


@pytest.fixture
def cited_runs(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    results.mkdir()
    for i, doc in enumerate(main_job_documents()):
        (results / f"{doc.header.run_id}-{i}.json").write_text(doc.to_json(), encoding="utf-8")
    return results


def test_the_answer_comes_first_as_decisions_linked_to_their_evidence(cited_runs: Path, tmp_path: Path) -> None:
    result = build_report(cited_runs, tmp_path / "out", plots=False, warn=lambda m: None, slo=SLO)
    md = (tmp_path / "out" / "report.md").read_text()
    headings = re.findall(r"^## (.+)$", md, re.M)
    assert headings[:2] == ["The answer", "Overview"]
    answer = md[md.index("## The answer"):md.index("## Overview")]
    assert answer.index("SLO: TTFT p99 ≤ 200 ms.") < answer.index("| Question")
    table = md_table_after(answer, "| Question")
    assert [row[0] for row in table[1:]] == [
        q if key != "latency" else f"{q} (TTFT p99 ≤ 200 ms)" for key, q in QUESTIONS.items()]
    alpha = column(table, "alpha")
    assert alpha[QUESTIONS["throughput"]].startswith("[batch ")
    assert "](#evidence-alpha-continuous)" in alpha[QUESTIONS["throughput"]]  # the curve it was read from
    assert alpha[f"{QUESTIONS['latency']} (TTFT p99 ≤ 200 ms)"].startswith("[batch 8 (ttft_p99 ")
    assert alpha[QUESTIONS["batching"]].startswith("[continuous at batch 8: x1.")
    assert "it pays for the padded slots" in alpha[QUESTIONS["padding"]] or \
        "more than those tokens explain, as if it padded" in alpha[QUESTIONS["padding"]]
    assert alpha[QUESTIONS["memory"]].startswith("[batch 16 (KV 95% full)")
    beta = column(table, "beta")
    assert beta[QUESTIONS["batching"]] == "[cannot be compared (no static-waves run)](#evidence-beta-continuous)"
    # The runs left out: a count per cause on the first screen, linked to the table that lists them.
    assert "| 1 of 40 | [failed requests: 1](#runs-left-out) |" in answer
    assert "## In detail" in md and "### Runs left out" in md
    assert "beta continuous c=16 | failed requests | beta-continuous-c16-r0" in md
    # The engines against each other: the pick first, its runner-up with the ratio, one table of every engine;
    # each pair's sentence in the details.
    assert answer.index("Pick: alpha at batch ") < answer.index("| Engine | Most output tok/s |")
    assert answer.index("| Engine | Most output tok/s |") < answer.index("| Question")
    assert "Runner-up: beta at batch " in answer
    assert "- Under continuous load, alpha gives x" in md and ", each at its best batch size (" in md
    # The evidence sections the decisions link to.
    assert "## Evidence: alpha, continuous" in md and "## Evidence: beta, continuous" in md
    stored = json.loads((tmp_path / "out" / "report.json").read_text())["findings"]
    assert stored["decisions"][0]["answers"][next(iter(QUESTIONS))] == alpha[QUESTIONS["throughput"]][1:].split(
        "](")[0]
    assert result.findings is not None and result.findings.slo == SLO


def test_html_links_resolve_and_the_answer_precedes_every_figure(cited_runs: Path, tmp_path: Path) -> None:
    build_report(cited_runs, tmp_path / "out", plots=True, warn=lambda m: None, slo=SLO)
    html = (tmp_path / "out" / "report.html").read_text()
    links = set(re.findall(r'href="#([^"]+)"', html))
    ids = set(re.findall(r'id="([^"]+)"', html))
    assert {"evidence-1", "invalid-runs"} <= links <= ids
    assert html.index('id="answer"') < first_figure(html)
    assert html.index("<details>") < html.index('id="answer"')  # the contents are folded away
    # The frontier across the engines, then one headline figure per engine, on the first screen after the decisions.
    answer = html[html.index('id="answer"'):html.index("Overview</h2>")]
    assert answer.count("<svg") == 1 + 2 and answer.index("Question") < first_figure(answer)
    assert "sweet spot c=8" in answer and "TTFT p99 SLO" in answer
    assert '<table class="prose">' in answer  # the decisions are sentences: read from the left


def test_without_an_engine_there_is_nothing_to_decide(tmp_path: Path) -> None:
    results = tmp_path / "results"
    odd = document(RunSpec(arrival="poisson"))
    odd.header = dataclasses.replace(odd.header, labels=RunLabels())
    results.mkdir()
    (results / "open-loop.json").write_text(odd.to_json(), encoding="utf-8")
    build_report(results, tmp_path / "out", plots=True, warn=lambda m: None)
    md = (tmp_path / "out" / "report.md").read_text()
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
    noise_and_regression(tmp_path / "a", tmp_path / "b")
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    blocks = {b.split("\n", 1)[0].split(" ")[0]: b for b in re.split(r"\n(?=\S)", out)}
    vllm_ttft = next(line for line in blocks["vllm"].splitlines() if "TTFT p99" in line)
    assert "137 [50.2–372] -> 150 [127–177]" in vllm_ttft and "+9.8%" in vllm_ttft
    assert vllm_ttft.endswith("within noise")
    tgi_ttft = next(line for line in blocks["tgi"].splitlines() if "TTFT p99" in line)
    assert tgi_ttft.endswith("REGRESSION")
    assert "1 regression," in out
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--fail-on-regression"]) == 1
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "nope")]) == 2
    assert "B " in capsys.readouterr().err


def test_several_engines_lead_with_one_frontier_the_pick_starred(cited_runs: Path, tmp_path: Path) -> None:
    result = build_report(cited_runs, tmp_path / "out", plots=True, warn=lambda m: None, slo=SLO)
    md = (tmp_path / "out" / "report.md").read_text()
    answer = md[md.index("## The answer"):md.index("## Overview")]
    frontier = answer.index("*Figure in report.html: The engines on one frontier: output tokens/s per accelerator")
    assert frontier < answer.index("*Figure in report.html: alpha, continuous:")
    assert "hollow points do not clearly meet the SLO, the star is the pick" in answer
    assert result.findings is not None and result.findings.pick is not None
    html = (tmp_path / "out" / "report.html").read_text()
    assert f"the pick: {result.findings.pick.engine} at batch {result.findings.pick.batch_size}" in html
    # The per-user figure is not drawn twice: the frontier is it.
    assert "Output tokens/s per accelerator against output tokens/s per user (per user" not in md


def test_every_point_gives_its_pooled_ttft_p99_with_its_own_interval_or_too_few(cited_runs: Path,
                                                                               tmp_path: Path) -> None:
    build_report(cited_runs, tmp_path / "out", plots=False, warn=lambda m: None, slo=SLO)
    md = (tmp_path / "out" / "report.md").read_text()
    table = md_table_after(md, "## Evidence: alpha, continuous")
    pooled = column(table, "TTFT p99 pooled")
    assert pooled and all(re.fullmatch(r"[\d.,]+ \[[\d.,]+–(\?|[\d.,]+)\], n=\d+(: too few \(needs 368\))?", v)
                          for v in pooled.values()), pooled
    stored = json.loads((tmp_path / "out" / "report.json").read_text())["findings"]["engines"]["alpha"]
    point = stored["layouts"]["continuous"]["points"][0]
    assert {"ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"} <= point["pooled"].keys()
    p99 = point["pooled"]["ttft_p99_s"]
    assert p99["needed"] == 368 and p99["bounded"] == (p99["n"] >= 368)
