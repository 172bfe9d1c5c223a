"""report.html in a real headless browser (Debian's chromium): no console errors, the answer before any figure.

String checks of the HTML cannot see what a browser does with it (a console error, a blocked resource, markup
that parses into a different tree). CI installs chromium (``.ci/run``) and sets ``BATCHBENCH_REQUIRE_BROWSER``,
so there the test fails rather than skips when the browser is missing; elsewhere it skips, saying why.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from batchbench.reports.build import build_report
from tests.test_report_findings import SLO, cited_runs  # noqa: F401 (a fixture)

CHROMIUM = shutil.which("chromium")
#: A console message as chromium logs it with --enable-logging=stderr (errors and uncaught exceptions included).
CONSOLE = re.compile(r":CONSOLE[:(]")


def _require_browser() -> str:
    if CHROMIUM is None:
        if os.environ.get("BATCHBENCH_REQUIRE_BROWSER"):
            pytest.fail("BATCHBENCH_REQUIRE_BROWSER is set but chromium is not installed (.ci/run installs it)")
        pytest.skip("chromium is not installed (apt-get install -y --no-install-recommends chromium)")
    return CHROMIUM


def render(page: Path, profile: Path) -> tuple[str, list[str]]:
    """The DOM chromium built from ``page`` and the console messages it logged."""
    proc = subprocess.run(
        [_require_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()],
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
    assert dom.index('id="answer"') < dom.index("<img")
    assert dom.count('src="data:image/png;base64,') >= 4
    # the first screen: the decisions, each linking to its evidence, then the engines against each other
    answer = dom[dom.index('id="answer"'):dom.index("Overview</h2>")]
    assert result.findings is not None
    first = result.findings.decisions[0].answers(SLO)["throughput"]
    assert first in answer and answer.index(first) < answer.index(result.findings.answer[0])
    assert 'href="#evidence-1"' in answer and 'id="evidence-1"' in dom
