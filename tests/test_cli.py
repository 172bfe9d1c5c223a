"""``batchbench run``, the README's main job, end to end against the vLLM protocol server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchbench.cli import main
from tests.server_process import serving


@pytest.fixture(scope="module")
def fake_vllm_url() -> Iterator[str]:
    with serving("batchbench.fixtures.protocol", "vllm", "--token-delay", "0.001", "--max-running", "1024") as url:
        yield url


def test_run_repeats_each_layout_and_reports_the_spread(fake_vllm_url: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--engine", "vllm", "--engine-url", f"vllm={fake_vllm_url}", "--repeats", "2",
                 "--results-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    docs = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    labels = sorted((d["labels"]["layout"], d["labels"]["repeat"]) for d in docs)
    assert labels == [("continuous", 0), ("continuous", 1), ("static-waves", 0), ("static-waves", 1)]
    # An engine at a URL runs in processes that are not ours to tell apart: its machine load is not measured.
    assert all(d["machine"] == {"foreign_share": None, "disturbed": False, "busy_share": 0.1} for d in docs)
    # The headline: medians of the two repeats per layout, and their ratio.
    assert "median (min-max) of 2" in out and "continuous/static-waves" in out
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert sorted((s["labels"]["layout"], s["repeats"]) for s in report["series"]) == [
        ("continuous", 2), ("static-waves", 2)]
    assert "### Across repeats" in (tmp_path / "report" / "report.md").read_text()


def test_run_refuses_zero_repeats(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--repeats", "0"])
    assert exit_info.value.code == 2
    assert "--repeats: must be at least 1, not 0" in capsys.readouterr().err
