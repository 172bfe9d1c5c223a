"""report.html in a real headless browser (Debian's chromium): no console errors, the answer before any figure,
and a report of the main job's size small and quick to open.

String checks of the HTML cannot see what a browser does with it (a console error, a blocked resource, markup
that parses into a different tree). CI installs chromium (``.ci/run``) and sets ``BATCHBENCH_REQUIRE_BROWSER``,
so there the test fails rather than skips when the browser is missing; elsewhere it skips, saying why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from batchbench.core.server_metrics import ServerMetrics
from batchbench.measures.guardrails import server_summary
from batchbench.reports.build import build_report
from batchbench.results.document import RunDocument
from tests.synthetic_runs import RunSpec, document
from tests.test_report_findings import SLO, cited_runs, first_figure  # noqa: F401 (a fixture)

CHROMIUM = shutil.which("chromium")
#: A console message as chromium logs it with --enable-logging=stderr (errors and uncaught exceptions included).
CONSOLE = re.compile(r":CONSOLE[:(]")


def _require_browser() -> str:
    if CHROMIUM is None:
        if os.environ.get("BATCHBENCH_REQUIRE_BROWSER"):
            pytest.fail("BATCHBENCH_REQUIRE_BROWSER is set but chromium is not installed (.ci/run installs it)")
        pytest.skip("chromium is not installed (apt-get install -y --no-install-recommends chromium)")
    return CHROMIUM


def render(page: Path | str, profile: Path, *flags: str) -> tuple[str, list[str]]:
    """The DOM chromium built from ``page`` (a file, or a file: URL) and the console messages it logged."""
    proc = subprocess.run(
        [_require_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *flags, "--dump-dom",
         page.as_uri() if isinstance(page, Path) else page],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, [line for line in proc.stderr.splitlines() if CONSOLE.search(line)]


def test_the_console_check_sees_an_error(tmp_path: Path) -> None:
    """The canary: a page that logs an error and throws is caught, so "no messages" below means something."""
    page = tmp_path / "canary.html"
    page.write_text("<!DOCTYPE html><p>x</p><script>console.error('canary'); missing();</script>")
    _, console = render(page, tmp_path / "profile")
    assert any("canary" in line for line in console)
    assert any("Uncaught ReferenceError" in line for line in console)


def test_the_report_renders_without_console_errors_and_leads_with_the_answer(
        cited_runs: Path, tmp_path: Path) -> None:  # noqa: F811 (the fixture)
    result = build_report(cited_runs, tmp_path / "out", plots=True, warn=lambda m: None, slo=SLO)
    dom, console = render(tmp_path / "out" / "report.html", tmp_path / "profile")
    assert console == []
    assert dom.count("<svg ") >= 4 and "<img" not in dom
    assert dom.index('id="answer"') < first_figure(dom)
    # the first screen: the pick across engines, then the decisions, each linking to its evidence
    answer = dom[dom.index('id="answer"'):dom.index("Overview</h2>")]
    assert result.findings is not None and result.findings.pick is not None
    first = result.findings.decisions[0].answers(SLO)["throughput"]
    assert first in answer and answer.index(result.findings.answer[0]) < answer.index(first)
    assert result.findings.answer[0].startswith(("Pick: ", "No pick: "))
    assert 'href="#evidence-1"' in answer and 'id="evidence-1"' in dom


# --------------------------------------------------------------------------- a report of the main job's size

#: A page that times another in an iframe: from asking for it (the file named after "#") to its load event and
#: the style and layout that reading its height forces, in milliseconds by the browser's own clock, written into
#: the DOM that --dump-dom prints. Chromium's start, the same for any page, is not in it. Reading the frame's
#: document needs --allow-file-access-from-files (file: pages are otherwise each their own origin).
PROBE = """<!DOCTYPE html><html><body><iframe id="page" style="width: 1400px; height: 900px"></iframe><script>
const frame = document.getElementById("page");
let start = 0;
frame.onload = () => {
  const doc = frame.contentDocument;
  const height = doc ? doc.documentElement.scrollHeight : null;
  const out = document.createElement("pre");
  out.id = "timing";
  out.textContent = JSON.stringify({ms: performance.now() - start, height: height,
                                    figures: doc ? doc.querySelectorAll("svg").length : null});
  document.body.appendChild(out);
};
start = performance.now();
frame.src = decodeURIComponent(location.hash.slice(1));
</script></body></html>
"""
TIMING = re.compile(r'<pre id="timing">([^<]*)</pre>')


def load_time(page: Path, profile: Path) -> dict[str, float]:
    """``page``'s load, style and layout in chromium (:data:`PROBE`): its ms, height and figure count."""
    probe = page.parent / "probe.html"
    probe.write_text(PROBE, encoding="utf-8")
    dom, console = render(f"{probe.as_uri()}#{page.name}", profile, "--allow-file-access-from-files")
    assert console == []
    found = TIMING.search(dom)
    assert found is not None, dom[-2000:]
    timing: dict[str, float] = json.loads(found.group(1))
    return timing


#: The main job's sweep: engines, layouts, batch sizes, repeats; the padding pair at one batch size.
ENGINES = ("alpha", "beta")
LAYOUTS = ("continuous", "static-waves")
LEVELS = (1, 2, 4, 8, 16, 32)
REPEATS = 3


def _scrapes(spec: RunSpec, doc: RunDocument, seed: int) -> RunDocument:
    """``doc`` with a scrape every quarter second, the KV cache and the queue moving as a real run's do, and
    its own workload hash: the main job's workloads differ by layout, batch size and engine (their tokenizers)."""
    assert doc.footer is not None and doc.footer.duration_s is not None
    rng = random.Random(seed)
    n = max(3, int(doc.footer.duration_s / 0.25))
    fill = min(1.0, spec.concurrency / 8)
    samples = [ServerMetrics(t=k * 0.25, kv_usage=min(1.0, fill * (0.6 + 0.4 * rng.random())),
                             running=float(rng.randint(1, min(spec.concurrency, 8))),
                             waiting=float(rng.randint(0, max(0, spec.concurrency - 8)))) for k in range(n)]
    workload = dataclasses.replace(
        doc.header.workload, name="padding" if spec.layout in ("padded-mixed", "homogeneous") else "regimes",
        hash=f"{spec.engine}-{spec.layout}-{spec.concurrency}".ljust(64, "0"))
    return dataclasses.replace(doc, header=dataclasses.replace(doc.header, workload=workload), server_metrics=samples,
                               footer=dataclasses.replace(doc.footer, guardrails=server_summary(samples)))


def main_job_documents() -> list[RunDocument]:
    """84 runs shaped like the main job's: two engines, two layouts at six batch sizes and the padding pair, three
    repeats each, a few dozen requests per run (more at larger batches), KV and queue scraped through each."""
    specs = [RunSpec(engine=engine, layout=layout, concurrency=c, repeat=r, requests=max(12, 2 * c),
                     throughput=100.0 * min(c, 8) * (1.0 if engine == "alpha" else 0.6) * (1 + 0.03 * r),
                     ttft=0.05 + 0.04 * max(0, c - 8), kv_usage=0.9, labels={"kv_fit": 8})
             for engine in ENGINES for r in range(REPEATS) for layout in LAYOUTS for c in LEVELS]
    specs += [RunSpec(engine=engine, layout=layout, concurrency=8, repeat=r, requests=16, kv_usage=0.5)
              for engine in ENGINES for r in range(REPEATS) for layout in ("padded-mixed", "homogeneous")]
    return [_scrapes(spec, document(spec), i) for i, spec in enumerate(specs)]


#: What a report of the main job may weigh and take to open (issue 16: the PNG report was 12 MB).
MAX_BYTES = 2_000_000
MAX_LOAD_S = 2.0


def test_a_main_job_sized_report_is_small_and_opens_in_under_two_seconds(tmp_path: Path) -> None:
    _require_browser()
    results = tmp_path / "results"
    results.mkdir()
    docs = main_job_documents()
    assert len(docs) >= 84
    for doc in docs:
        (results / f"{doc.header.run_id}.json").write_text(doc.to_json(), encoding="utf-8")
    result = build_report(results, tmp_path / "out", warn=lambda m: None)
    assert result.findings is not None and len(result.inputs.runs) == len(docs)
    page = tmp_path / "out" / "report.html"
    html = page.read_text(encoding="utf-8")
    assert page.stat().st_size < MAX_BYTES, f"report.html is {page.stat().st_size} bytes"
    assert html.count("<svg ") >= 20  # the findings' figures and one per workload, all inline
    assert html.index('id="answer"') < first_figure(html)
    assert html.count('<details><summary>Per-run figures</summary>') >= 20  # the per-run tables, folded
    # best of two: a run on a loaded machine can only be slower, never faster, than the page itself allows
    timings = [load_time(page, tmp_path / f"profile-{i}") for i in range(2)]
    assert all(t["figures"] == html.count("<svg ") for t in timings)  # the probe saw the whole page
    best = min(t["ms"] for t in timings) / 1000
    assert best < MAX_LOAD_S, f"report.html took {best:.2f} s to load and lay out ({timings})"


def test_time_slices_render_as_a_figure_and_a_table(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    for engine, throughput in (("alpha", 400.0), ("beta", 250.0)):
        doc = document(RunSpec(engine=engine, throughput=throughput, decoding=0.3, kv_usage=0.5, waiting=1.0,
                               slice_s=1.0))
        (results / f"{engine}.json").write_text(doc.to_json())
    build_report(results, tmp_path / "out", plots=True, warn=lambda m: None)
    dom, console = render(tmp_path / "out" / "report.html", tmp_path / "profile")
    assert console == []
    section = dom[dom.index("Over the run, by time window"):]
    assert section.index("<svg ") < section.index("Per-window figures")  # the figure, then the windows' table
    assert "TTFT p99 ms" in section and "out tok/s" in section
