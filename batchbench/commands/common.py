"""What every ``batchbench`` command shares: exit statuses, argument types, the run folder, failure lines."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from batchbench.adapters.auth import EngineUnauthorized
from batchbench.adapters.base import Engine
from batchbench.adapters.registry import EngineOptions, engine_class, make_engine, model_dir
from batchbench.adapters.served import ServedModel, fetch_served_models, pick_served_model
from batchbench.analysis import validity
from batchbench.analysis.accelerators import Accelerator
from batchbench.analysis.findings import QUESTIONS, Findings
from batchbench.analysis.findings.decisions import slo_text
from batchbench.core import eventloop
from batchbench.core.config import BatchingConfig
from batchbench.load.engines import EngineCache
from batchbench.load.pinning import pinned_process
from batchbench.load.runner import MeasuredRun
from batchbench.measures.slo import Slo
from batchbench.progress import EngineStart, Progress
from batchbench.workload.lora import Lora, LoraSpec, materialize

#: Exit statuses (docs/main-job.md lists them). A stop by SIGTERM or SIGHUP exits 128 + the signal's number (143, 129).
EXIT_OK, EXIT_FAILURES, EXIT_USAGE, EXIT_ENGINE, EXIT_WRITE, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130

#: The signals a job scheduler stops a job with (Slurm, Kubernetes, a CI timeout: SIGTERM; a closed terminal:
#: SIGHUP): each finishes a command as Ctrl-C does.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C's KeyboardInterrupt would be, so every ``except KeyboardInterrupt``
    and ``finally`` on the way out runs as for Ctrl-C: runs cut short are folded into their documents with status
    ``interrupted``, summaries written, engines stopped (the launchers' cleanup registry stops its servers first,
    then chains to this handler)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupted_status(stop: KeyboardInterrupt) -> int:
    """The exit status of a command stopped by ``stop``: 130 for Ctrl-C, 128 + the signal for SIGTERM/SIGHUP."""
    return 128 + stop.signum if isinstance(stop, Terminated) else EXIT_INTERRUPTED


def interrupted_by(stop: KeyboardInterrupt) -> str:
    """``interrupted`` or ``stopped by SIGTERM``: how the command's last line names the stop."""
    return f"stopped by {stop}" if isinstance(stop, Terminated) else "interrupted"


@contextmanager
def stop_signals_as_interrupts() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`Terminated` in the main thread for the block, or, while the command's
    event loop runs, cancel it as Ctrl-C does and have it raise :class:`Terminated` once everything on the way
    out has run (:func:`batchbench.core.eventloop.interrupt`). Ignored ones, as under ``nohup``, stay ignored.
    The first one only: a second while the command finishes is ignored, since cutting the finishing short would
    lose what it is saving."""
    def stop(signum: int, frame: object) -> None:
        for sig in installed:
            signal.signal(sig, signal.SIG_IGN)
        if not eventloop.interrupt(Terminated(signum)):  # a measuring loop is cancelled as Ctrl-C cancels it
            raise Terminated(signum)

    installed = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS if signal.getsignal(sig) != signal.SIG_IGN}
    for sig in installed:
        signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, previous in installed.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def concurrency_list(text: str) -> tuple[int, ...]:
    """``1,2,4`` -> (1, 2, 4): distinct levels of at least 1, in increasing order (every command's batch sizes)."""
    levels: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected whole numbers separated by commas, e.g. 1,4,16") \
                from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: a concurrency must be at least 1, not {value}")
        levels.add(value)
    if not levels:
        raise argparse.ArgumentTypeError(f"{text!r}: expected whole numbers separated by commas, e.g. 1,4,16")
    return tuple(sorted(levels))


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, not {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return value


def parsed_by(cls: type[Any]) -> Callable[[str], Any]:
    """An argparse type from a class's ``parse`` classmethod (``Slo``, ``Lengths``): its ValueError, which
    names the user's text, becomes argparse's usage error."""
    def convert(text: str) -> Any:
        try:
            return cls.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = cls.__name__.lower()
    return convert


def served_models_at_urls(engines: Sequence[str], options: EngineOptions) -> ServedModel | None:
    """Each engine at a URL: the served model ``--model`` means (a served name, or the path it was loaded from),
    said in a line with the name requests will give; ValueError naming the served models when it means none. The
    first such engine's model is returned: its ``root`` is the tokenizer a text dataset is read with. A server
    that cannot say (no /v1/models, not reachable yet) is left to its start. One that answers 401/403 wants a key
    (or refused the one sent): a ValueError saying so, before anything starts."""
    first: ServedModel | None = None
    for name in engines:
        if (url := options.url_for(name)) is None:
            continue
        try:
            served = asyncio.run(fetch_served_models(name, url, options.auth))
        except EngineUnauthorized as exc:
            raise ValueError(str(exc)) from None
        if served is None:
            continue
        model = pick_served_model(options.model, served, f"{name} at {url}")
        if not model.listed:
            print(f"batchbench: {name} at {url}: /v1/models does not list --model {model.name} (it lists none); "
                  "requests name it as given, and the first request decides")
            continue
        given = f" (--model {options.model})" if options.model and options.model != model.name else ""
        print(f"batchbench: {name} at {url} serves {model.text()}; requests name {model.name}{given}")
        first = first or model
    return first


def one_batching(specs: list[str], command: str, engines: Sequence[str] = ()) -> BatchingConfig | None:
    """The one ``--batching`` a measuring command takes (None: the engine's default); ValueError for several,
    and for one that any of ``engines`` refuses (``Engine.check_config``: the field named, before a start)."""
    if len(specs) > 1:
        raise ValueError(f"--batching: {command} measures one configuration per invocation; give it once")
    batching = BatchingConfig.parse(specs[0]) if specs else None
    if batching is None:  # none given, or "default": nothing for an engine to refuse
        return None
    for name in engines:
        try:
            engine_class(name).check_config(batching)
        except ValueError as exc:
            raise ValueError(f"--batching {specs[0]!r}: {exc}") from None
    return batching


def check_lora_specs(specs: tuple[LoraSpec, ...], engines: tuple[str, ...],
                        batching: BatchingConfig | None) -> None:
    """Refuse ``--lora-adapters`` an engine would not serve (no LoRA on it, a rank above max_lora_rank), naming
    the adapter and the field, before a run folder is made or an engine starts."""
    loras = [Lora(s.name, s.path or Path(s.name), s.known_rank()) for s in specs]
    for name in engines:
        engine_class(name).check_loras(batching or BatchingConfig(), loras)


def serve_loras(specs: tuple[LoraSpec, ...], options: EngineOptions, run_dir: Path,
                        seed: int) -> EngineOptions:
    """The options with the adapters the engines serve: those to make written into the run folder (for the
    embedded model, or ``--model`` when it is a local directory)."""
    if not specs:
        return options
    loras = materialize(specs, model_dir(options.model), run_dir / "lora-adapters", seed=seed)
    return dataclasses.replace(options, loras=loras)


@contextmanager
def place_client(options: EngineOptions) -> Iterator[None]:
    """This whole process, the load generator, on the placement's first client CPU for the block, which starts
    the engines (a launched engine sets its own CPUs), having said where everything goes; the OS refusing is
    said too, and recorded in every results document, but does not stop the measurement."""
    with pinned_process(options) as pin:
        if pin.placement is None:
            print(f"batchbench: no CPU placement: {pin.unplaced}")
        else:
            print(f"batchbench: {pin.placement.describe()}")
        if pin.refused is not None:
            print(f"batchbench: warning: the load generator is not pinned: {pin.refused}", file=sys.stderr)
        yield


def run_dir_name(results_dir: Path, prefix: str) -> Path:
    """``RESULTS_DIR/PREFIX-YYYYmmdd-HHMMSS-xxxx``: one invocation's folder (a command's, a pytest session's)."""
    return results_dir / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


def make_run_dir(results_dir: Path, prefix: str) -> Path | None:
    """A fresh folder ``RESULTS_DIR/PREFIX-YYYYmmdd-HHMMSS-xxxx`` for one invocation, announced; None (and why,
    on stderr) when it cannot be made, which the caller turns into a usage error before any engine starts.

    One folder per invocation, and reports built from that folder alone, so runs of different invocations
    are never merged by accident."""
    run_dir = run_dir_name(results_dir, prefix)
    try:
        run_dir.mkdir(parents=True)
    except OSError as exc:
        print(f"batchbench: cannot write results under {results_dir}: {exc}", file=sys.stderr)
        return None
    print(f"batchbench: results in {run_dir}")
    return run_dir


def died(result: MeasuredRun) -> str | None:
    """Why the engine is gone, if this run says so: a record that saw it die, or nothing reachable at all."""
    for record in result.records:
        if record.error_kind == "engine_died":
            return record.error
    if result.records and all(r.error_kind in ("unreachable", "engine_died") for r in result.records):
        return result.records[0].error
    return None


def failure_lines(result: MeasuredRun, timeout_s: float) -> list[str]:
    """Failed requests by kind with the first message; a timed-out request's wait is in the run's duration."""
    kinds = result.summary.failures  # the summary already counts them by kind
    if not kinds:
        return []
    first = next(r.error for r in result.records if not r.ok)
    by_count = sorted(kinds.items(), key=lambda kind_n: -kind_n[1])
    lines = [f"failed: {', '.join(f'{n} {kind}' for kind, n in by_count)}; first: {first}"]
    if kinds.get("timeout"):
        lines.append(f"{kinds['timeout']} request(s) hit the {timeout_s:g}s request timeout: this run's duration, "
                     "and so its throughput, include that wait (--request-timeout)")
    return lines


def verdict_lines(result: MeasuredRun) -> list[str]:
    """The run's verdict as it ends, from its client and machine loads through :mod:`batchbench.analysis.validity`:
    ``INVALID (kind): sentence`` per rule they broke, then ``warning: ...`` per caveat that does not invalidate
    it (chunks the server delivered together). Failed requests have lines of their own (:func:`failure_lines`)."""
    return ([reason.line() for reason in validity.load_reasons(result.client, result.machine)]
            + [f"warning: {note}" for note in [*result.client.notes(), *connection_notes(result)]])


def connection_notes(result: MeasuredRun) -> list[str]:
    """Requests sent again because a kept-alive connection had been closed before they were answered (the server
    never saw them: not failures), and why the client stopped reusing connections."""
    resent = sum(1 for r in result.records if r.resent)
    if not resent:
        return []
    why = result.engine_report.get("connections")
    return [f"{resent} request(s) sent again on a fresh connection after the kept-alive one closed unanswered"
            + (f"; {why}" if isinstance(why, str) else "")]


def answer_lines(findings: Findings) -> list[str]:
    """The answer as the report's first screen gives it: the pick across engines, then per engine each question's
    one line, then what was left out."""
    lead = findings.pick.sentences() if findings.pick is not None else []
    lines = list(lead)
    for d in findings.decisions:
        lines.append(f"{d.engine}:")
        answers = d.answers(findings.slo)
        lines += [f"  {QUESTIONS[key]}: {answers[key]}" for key in QUESTIONS]
    lines += [f"- {sentence}" for sentence in findings.answer[len(lead):]]
    return lines


def write_report(run_dir: Path, status: int, slo: Slo | None, *, details: bool = False,
                 gpu: Accelerator | None = None) -> int:
    """Build the run folder's report under ``slo`` (its limit on paper for ``gpu`` where given, else each run's own
    GPU), print the answer (``details``: every topic's sentence too) and where the report went; the exit status,
    raised to 1 if no report could be built."""
    from batchbench.reports.build import ReportError, build_report  # the report is the last step, and heavy

    try:
        report = build_report(run_dir, run_dir / "report", slo=slo, gpu=gpu)
    except ReportError as exc:
        print(f"batchbench: results written, but no report: {exc}", file=sys.stderr)
        return max(status, EXIT_FAILURES)
    if report.findings is not None:
        print(f"batchbench: the answer (SLO: {slo_text(slo)}):")
        for line in answer_lines(report.findings):
            print(f"  {line}")
        for sentence in report.findings.details if details else ():
            print(f"  - {sentence}")
    print(f"batchbench: report written to {report.out_dir}")
    return status


#: In a log (nothing redrawn), how often a start that waits says how far it got.
LOG_DETAIL_EVERY_S = 10.0


class StartingEngines:
    """Engines for a command's :class:`~batchbench.load.engines.EngineCache`, each start shown on the progress display.

    The cache makes an engine (this class is its factory) inside its own ``get``, so the start is shown around
    that call and the engine, once made, gives the display its timeout and server log to follow.
    """

    def __init__(self, options: EngineOptions, progress: Progress) -> None:
        self.options, self.progress = options, progress
        self._start: EngineStart | None = None
        self._detail_logged = time.monotonic()

    def make(self, name: str, batching: BatchingConfig | None) -> Engine:
        engine = make_engine(name, batching, self.options)
        if self._start is not None:
            self._start.attach(engine.startup_timeout, engine.server_log)
        return engine

    def cache(self, warm_up_timeout_s: float) -> EngineCache:
        """An engine cache holding one live engine at a time (measured engines never share the machine), each
        warm-up request bounded by ``warm_up_timeout_s`` (the command's request timeout)."""
        return EngineCache(self.make, max_live=1, warm_up_timeout_s=warm_up_timeout_s, phase=self.phase,
                           warm_up_report=self.warm_up_report)

    def phase(self, what: str, timeout_s: float | None) -> None:
        """The start under way waits for ``what`` now: on the live display, and as a line in a log (where
        nothing is redrawn, a start that hangs would otherwise say nothing at all)."""
        if self._start is None:
            return
        self._start.wait_for(what, timeout_s)
        if not self.progress.live:
            bound = f" (at most {timeout_s:g}s)" if timeout_s else ""
            self.progress.print(f"batchbench: {self._start.name}: waiting for {what}{bound}")

    def warm_up_report(self, text: str) -> None:
        """Which warm-up request the start waits for: on the live display as it changes, in a log at most every
        :data:`LOG_DETAIL_EVERY_S` (a sign of life, not a line a second)."""
        if self._start is None:
            return
        self._start.detail = text
        if not self.progress.live and time.monotonic() - self._detail_logged >= LOG_DETAIL_EVERY_S:
            self._detail_logged = time.monotonic()
            self.progress.print(f"batchbench: {self._start.name}: warm-up: {text}")

    async def get(self, cache: EngineCache, name: str, batching: BatchingConfig | None) -> Engine:
        """The live engine, or one started now with its start on the display."""
        if cache.is_live(name, batching):
            return await cache.get(name, batching)
        with self.progress.engine_starting(name) as start:
            self._start = start
            try:
                return await cache.get(name, batching)
            finally:
                self._start = None
