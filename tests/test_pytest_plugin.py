"""batchbench's fixtures in a user's own repository: the pytest11 plugin, with no conftest.py of ours."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

USER_SUITE = '''
from batchbench.workload.requests import Arrival, Lengths, WorkloadSpec


def test_my_workload(start_engine, harness, engine_name):
    engine = start_engine(engine_name)
    workload = WorkloadSpec("mine", 8, prompt=Lengths.fixed(16), output=Lengths.fixed(8),
                            arrival=Arrival("closed", concurrency=4), seed=1).build()
    result = harness.measure(engine, workload, tag="mine")
    assert result.summary.ok == 8
    assert result.path.is_file()
'''


def _pytest(repo: Path, *args: str, timeout: float = 60,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=repo,
                          capture_output=True, text=True, timeout=timeout, check=False, env=env)


@pytest.fixture
def user_repo(tmp_path: Path) -> Path:
    (tmp_path / "test_mine.py").write_text(USER_SUITE)
    return tmp_path


def test_help_lists_the_options_in_a_repository_of_its_own(user_repo: Path) -> None:
    proc = _pytest(user_repo, "--help")
    assert proc.returncode == 0, proc.stderr
    for option in ("--engine=", "--engine-url=", "--batching=", "--profile=", "--results-dir=", "--max-live-engines",
                   "--api-key=", "--header=", "--endpoint=", "--image="):
        assert option in proc.stdout


def test_a_bad_option_is_a_usage_error_before_anything_starts(user_repo: Path) -> None:
    proc = _pytest(user_repo, "--engine", "vllm", "--batching", "chunked_prefill=ture")
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage-error exit code
    assert "chunked_prefill='ture': expected true or false" in proc.stderr


@pytest.mark.engine
def test_pytest_engine_vllm_runs_a_users_suite(user_repo: Path) -> None:
    proc = _pytest(user_repo, "--engine", "vllm", "--results-dir", "out", "-q", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 passed" in proc.stdout
    assert list((user_repo / "out").glob("pytest-*/vllm_*mine*.json"))  # the session's own folder


def test_an_engine_that_cannot_run_skips_or_with_require_engines_fails(user_repo: Path) -> None:
    # No Docker engine answers (DOCKER_HOST points where nothing listens, whether or not this machine runs one: a
    # daemon that reaches a registry would pull TGI's image): tgi in a container cannot run, a skip with the reason ...
    args = ("--engine", "tgi", "--model", "org/model", "--launch", "docker", "-rs")
    nowhere = os.environ | {"DOCKER_HOST": "tcp://127.0.0.1:9"}
    skipped = _pytest(user_repo, *args, timeout=120, env=nowhere)
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout[-2000:]
    # ... unless the run requires its engines, as the nightly GPU job does.
    failed = _pytest(user_repo, *args, "--require-engines", timeout=120, env=nowhere)
    assert failed.returncode == 1 and "1 failed" in failed.stdout and "--require-engines" in failed.stdout
    assert "docker engine not reachable at tcp://127.0.0.1:9" in failed.stdout


def test_the_tests_on_one_engine_run_together_in_the_engines_order(tmp_path: Path) -> None:
    # Two files, each with a test on every engine: run as collected, the engines alternate and each would be
    # stopped and started again in the next file (the shared engines are few at once).
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / name).write_text("def test_on(engine_name):\n    pass\n\n\ndef test_off():\n    pass\n")
    proc = _pytest(tmp_path, "--engine", "hf-static", "--engine", "vllm", "--collect-only", "-q")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    # The tests on engines take their places in engine order; the others keep theirs.
    assert collected == ["test_a.py::test_on[hf-static]", "test_b.py::test_on[hf-static]", "test_a.py::test_off",
                         "test_a.py::test_on[vllm]", "test_b.py::test_on[vllm]", "test_b.py::test_off"]
