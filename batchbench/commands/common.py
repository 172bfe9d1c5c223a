"""What every ``batchbench`` command shares: usage errors, stop signals as interrupts, the run folder, the models
engines at URLs serve."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from batchbench.adapters.auth import EngineUnauthorized
from batchbench.adapters.registry import EngineOptions, engine_class, model_dir
from batchbench.adapters.served import ServedModel, fetch_served_models, pick_served_model
from batchbench.core import eventloop
from batchbench.core.config import BatchingConfig
from batchbench.core.exits import EXIT_INTERRUPTED, UsageError
from batchbench.workload.lora import Lora, LoraSpec, materialize

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


@contextmanager
def usage_errors() -> Iterator[None]:
    """The options' checks, where a ValueError is the user's mistake (each names the option and the fix): raised as
    :class:`UsageError`, which :func:`batchbench.cli.main` says in one line with exit status 2. Only around the
    checks: a ValueError anywhere else is a bug and keeps its traceback."""
    try:
        yield
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


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


