"""docs/suites.md's "Your own test", run as a user runs it: copied into an empty folder outside the repository (no
conftest, no pytest configuration), against a real engine, through the installed plugin. It fails when the page
and the API drift apart, when batchbench makes the run print a warning, and when the session's end does not say
where its results are or (``--batchbench-report``) does not write the report; ``--baseline`` with
``--fail-on-regression`` fails the session on a regression."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine]

PAGE = Path(__file__).resolve().parents[1] / "docs" / "suites.md"
MARK = "<!-- your-own-test:"


def example() -> str:
    """The page's example: the python block after its marker."""
    text = PAGE.read_text()
    found = re.search(re.escape(MARK) + r".*?-->\s*```python\n(.*?)```", text, re.S)
    assert found, f"{PAGE.name} has no example after {MARK!r}"
    return found.group(1)


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_my_slo.py", *args],
                          cwd=folder, capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("user")
    (where / "test_my_slo.py").write_text(example())
    return where


def test_the_documented_example_passes_cleanly_and_says_where_its_results_are(folder: Path) -> None:
    done = _pytest(folder, "--engine", "hf-static", "-W", "error::DeprecationWarning")
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "1 passed" in done.stdout, out[-3000:]
    assert "warning" not in out.lower(), out[-3000:]
    (session,) = (folder / "results").glob("pytest-*")
    assert len(list(session.glob("hf-static_*my-slo*.json"))) == 3  # harness.repeat's three runs
    assert f"batchbench: 3 results documents in results/{session.name}; their report: batchbench report" in out


def test_the_report_is_one_option_away_and_a_regression_fails_the_nightly_session(folder: Path) -> None:
    done = _pytest(folder, "--engine", "hf-static", "--batchbench-report")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    session = max((folder / "results").glob("pytest-*"), key=lambda p: p.stat().st_mtime)
    report = session / "report" / "report.html"
    assert report.is_file() and f"report: results/{session.name}/report/report.html" in done.stdout
    # A baseline ten times as fast: this session's throughput is a regression far beyond noise.
    rows = json.loads((session / "report" / "report.json").read_text())
    for row in rows["runs"]:
        for metric in ("output_token_throughput", "request_throughput"):
            row["metrics"][metric] *= 10
    baseline = folder / "fast.json"
    baseline.write_text(json.dumps(rows))
    gated = _pytest(folder, "--engine", "hf-static", "--baseline", str(baseline), "--fail-on-regression")
    assert gated.returncode == 1 and "1 passed" in gated.stdout, (gated.stdout + gated.stderr)[-3000:]
    assert re.search(r"batchbench: [1-9]\d* regressions beyond 10% against", gated.stdout)
