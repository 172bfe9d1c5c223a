"""The prepared GPU device check (docker/device-check.sh), in its reduced form on this CPU: end to end.

The same script, steps and output layout as on an H200 (docs/gpu.md), with the tiny model, two concurrency
levels, one repeat and hf-static only; an engine the registry lacks is skipped and said. Without NVML every run's
GPU fields are there and say why they are empty.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchbench.results.discovery import discover

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.engine
@pytest.mark.timeout(240)
def test_the_reduced_device_check_runs_end_to_end_and_writes_under_out(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(
        ["bash", str(REPO / "docker" / "device-check.sh"), "--engines", "hf-static,not-an-engine", "--model",
         "tiny-llama", "--levels", "1,2", "--repeats", "1", "--suites",
         "suites/test_static_vs_continuous.py"],
        env=env, capture_output=True, text=True, timeout=230, check=False)
    out = tmp_path / "device-check"
    status = (out / "status.txt").read_text(encoding="utf-8")
    assert done.returncode == 0, f"{status}\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    assert "skipping not-an-engine: no such engine" in status
    for step in ("run", "suites", "suites-report"):
        assert f"{step}: exit 0" in status and (out / f"{step}.log").is_file()
    assert '"model": "tiny-llama"' in (out / "plan.json").read_text(encoding="utf-8")
    assert (out / "suites" / "junit.xml").is_file() and (out / "suites" / "report" / "report.md").is_file()
    (run_dir,) = (out / "run").glob("run-*")
    assert (run_dir / "report" / "report.md").is_file()
    found = discover(run_dir)
    layouts = {doc.header.labels.layout for _, doc in found.documents}
    assert {"continuous", "static-waves", "padded-mixed", "homogeneous"} <= layouts
    for _, doc in found.documents:
        assert doc.header.engine_name == "hf-static" and doc.header.gpus is not None
        assert doc.footer is not None and doc.footer.gpu is not None and doc.footer.summary is not None
        energy = doc.footer.summary.energy
        assert energy is not None
        if doc.footer.gpu.unavailable is not None:  # no GPU here: said, not guessed
            assert energy.unavailable == doc.footer.gpu.unavailable and energy.tokens_per_joule is None
