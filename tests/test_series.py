"""Repeats group into series only when they measured the same thing on the same server."""

from __future__ import annotations

from typing import Any

from batchbench.core.config import EngineDescription
from batchbench.reports.model import serving_identity
from batchbench.reports.series import group_series


def described(*, model: str = "org/m", mode: str = "LocalProcess", url: str = "http://127.0.0.1:40001",
              args: tuple[str, ...] = ("--max-num-seqs", "8"), version: str | None = "0.32.0") -> EngineDescription:
    return EngineDescription.of({
        "engine": "vllm", "model": {"path": model, "dummy_weights": False}, "mode": mode, "url": url,
        "server_args": ["--model", model, "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1], *args],
        "version": version})


def row(run_id: str, description: EngineDescription, repeat: int = 0) -> dict[str, Any]:
    return {"run_id": run_id, "engine": "vllm", "serving": serving_identity(description),
            "batching_label": "continuous",
            "workload": {"name": "chat", "hash": "abc"}, "labels": {"layout": "continuous", "repeat": repeat},
            "metrics": {}}


def test_a_launched_servers_fresh_port_is_not_a_difference() -> None:
    first, second = described(url="http://127.0.0.1:40001"), described(url="http://127.0.0.1:40002")
    assert serving_identity(first) == serving_identity(second)
    assert "--port" not in serving_identity(first)["server_args"]
    assert [len(s.rows) for s in group_series([row("a", first, 0), row("b", second, 1)])] == [2]


def test_runs_that_served_differently_are_never_one_series() -> None:
    base = described()
    others = [described(model="org/other"), described(args=("--max-num-seqs", "16")), described(version="0.33.0"),
              described(mode="url", url="http://gpu-a:8000"), described(mode="url", url="http://gpu-b:8000")]
    rows = [row("base", base)] + [row(f"r{i}", d, i + 1) for i, d in enumerate(others)]
    assert [len(s.rows) for s in group_series(rows)] == [1] * 6


def test_a_copy_of_a_run_is_not_another_repeat() -> None:
    d = described()
    assert [len(s.rows) for s in group_series([row("a", d, 0), row("a", d, 0), row("b", d, 1)])] == [2]
