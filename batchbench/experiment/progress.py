"""Progress of the long steps (an engine starting, a run, a sweep), live on a terminal and as plain lines in logs.

An engine start takes minutes and a sweep hours: without a sign of life a
user cannot tell a slow start from a hung one. On a terminal a live display
(rich) shows what is under way: the engine starting, with its elapsed time
against its timeout and the last line of its server log; the run, with
requests done of the total, output tokens/s so far and errors; and the
sweep's position. When stdout is not a terminal (CI logs) nothing is redrawn:
one plain line per finished step, no carriage returns.

The measured loop is never slowed: a run's :meth:`RunProgress.observe` only
adds to three counters; the display reads them from rich's own refresh thread
at most :data:`REFRESH_PER_SECOND` times a second.

Commands use it as::

    with Progress.for_terminal() as progress:
        with progress.engine_starting("vllm", 300, log_file) as start:
            ...
        progress.sweep(1, 8, "c=1")
        with progress.run(total=64, label="vllm continuous #0") as bar:
            ...  # bar.observe(record) per finished request, or bar.update(done, tokens, errors)
            bar.finish("the line this run leaves behind")
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from batchbench.core.records import RequestRecord

#: How often the live display is redrawn.
REFRESH_PER_SECOND = 4
#: How much of the end of a server log is read for its last line.
_LOG_TAIL_BYTES = 4096
_BAR_WIDTH = 24

LogFile = Path | Callable[[], Path | None] | None


def _clock(seconds: float) -> str:
    """``4:05``: minutes and seconds (none below zero)."""
    whole = max(0, round(seconds))
    return f"{whole // 60}:{whole % 60:02d}"


def last_log_line(log_file: LogFile) -> str:
    """The last non-empty line of a server log ("" when there is none yet): what the server is doing now."""
    path = log_file() if callable(log_file) else log_file
    if path is None:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - _LOG_TAIL_BYTES))
            tail = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.replace("\r", "\n").splitlines() if line.strip()]
    return "".join(ch for ch in lines[-1] if ch.isprintable()) if lines else ""


@dataclass
class EngineStart:
    """An engine being started: its name, timeout and log, and when the start began."""

    name: str
    timeout_s: float | None
    log_file: LogFile
    started: float = field(default_factory=time.monotonic)
    #: What the start waits for now (its health check, its warm-up), its own bound and since when.
    waiting: tuple[str, float | None, float] | None = None
    #: How far that wait got (the warm-up request waited for), "" when nothing is known.
    detail: str = ""

    def attach(self, timeout_s: float | None = None, log_file: LogFile = None) -> None:
        """The timeout and the log once known (an engine made inside a cache is only seen after the start began)."""
        if timeout_s is not None:
            self.timeout_s = timeout_s
        if log_file is not None:
            self.log_file = log_file

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def wait_for(self, what: str, timeout_s: float | None) -> None:
        """The start now waits for ``what``, for at most ``timeout_s`` (None: no bound of its own)."""
        self.waiting = (what, timeout_s, time.monotonic())
        self.detail = ""

    def timing(self) -> str:
        limit = f" of {self.timeout_s:.0f}s" if self.timeout_s else ""
        return f"{self.elapsed:.1f}s{limit}"

    def render(self) -> Text:
        head = f"starting {self.name}: {self.timing()}"
        if self.waiting is not None:
            what, limit, since = self.waiting
            head = (f"starting {self.name}: waiting for {what} ({time.monotonic() - since:.1f}s"
                    + (f" of {limit:g}s" if limit else "") + f"; {self.elapsed:.1f}s in all)")
            if self.detail:
                head += f": {self.detail}"
        text = Text(head, no_wrap=True, overflow="ellipsis")
        if line := last_log_line(self.log_file):
            text.append(f"  log: {line}", style="dim")
        return text


@dataclass
class RunProgress:
    """One run: requests done of ``total``, output tokens and errors so far."""

    total: int
    label: str
    done: int = 0
    tokens: int = 0
    errors: int = 0
    started: float = field(default_factory=time.monotonic)
    line: str | None = None

    def update(self, done: int, tokens: int, errors: int) -> None:
        """The counts so far (a caller that keeps its own)."""
        self.done, self.tokens, self.errors = done, tokens, errors

    def observe(self, record: RequestRecord) -> None:
        """Count one finished request: a load generator's ``on_record``. Three additions, nothing drawn here."""
        self.done += 1
        self.tokens += sum(record.chunk_tokens)
        self.errors += not record.ok

    def finish(self, line: str) -> None:
        """The line this run leaves behind (its caller knows which figures are worth it); a default otherwise."""
        self.line = line

    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def counts(self) -> str:
        return f"{self.done}/{self.total} requests, {self.rate():.1f} out tok/s, {self.errors} errors"

    def render(self) -> Text:
        filled = round(_BAR_WIDTH * self.done / self.total) if self.total else 0
        text = Text(f"{self.label} ", no_wrap=True, overflow="ellipsis")
        text.append("█" * filled + "░" * (_BAR_WIDTH - filled), style="cyan")
        text.append(f" {self.counts()}", style="bold red" if self.errors else "")
        return text


class Progress:
    """The live display on a terminal, plain lines elsewhere (module docstring)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live = console.is_terminal
        self._starts: list[EngineStart] = []
        self._runs: list[RunProgress] = []
        self._sweep: tuple[int, int, str, bool] | None = None
        #: When the sweep's time limit ends (time.monotonic), for the live countdown.
        self._deadline: float | None = None
        self._display: Live | None = None
        #: Whether an interrupt was reported (its one line printed), so the command need not say it again.
        self.interrupted = False

    @classmethod
    def for_terminal(cls, file: TextIO | None = None) -> Progress:
        """Progress on ``file`` (stdout by default): live when it is a terminal."""
        return cls(Console(file=file, highlight=False, soft_wrap=True))

    def __enter__(self) -> Progress:
        if self.live:
            self._display = Live(get_renderable=self._render, console=self.console, transient=True,
                                 refresh_per_second=REFRESH_PER_SECOND, redirect_stdout=False, redirect_stderr=False)
            self._display.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._display is not None:
            self._display.stop()
            self._display = None

    def _render(self) -> Group:
        parts: list[Text] = []
        if self._sweep is not None:
            i, n, label, extra = self._sweep
            left = f", {_clock(self._deadline - time.monotonic())} left" if self._deadline is not None else ""
            parts.append(Text(f"sweep: {_point(i, n, extra)}" + (f" ({label}{left})" if label else ""),
                              style="bold"))
        parts += [start.render() for start in self._starts]
        parts += [run.render() for run in self._runs]
        return Group(*parts)

    def refresh(self) -> None:
        """Redraw now (the display also redraws by itself a few times a second)."""
        if self._display is not None:
            self._display.refresh()

    def print(self, line: str, *, err: bool = False) -> None:
        """A finished step's line: above the live display on a terminal, a plain line elsewhere.

        ``err`` lines (what went wrong) go to stderr in a log; on a terminal they go above the display too,
        since a line written past it to stderr would be drawn over at the next refresh.
        """
        if err and not self.live:
            print(line, file=sys.stderr, flush=True)
        else:
            self.console.print(line, markup=False, highlight=False, emoji=False)

    @contextmanager
    def engine_starting(self, name: str, timeout_s: float | None = None,
                        log_file: LogFile = None) -> Iterator[EngineStart]:
        """Shows the start under way; prints one line when it is done, or when Ctrl-C cut it short.

        An interrupt (KeyboardInterrupt, or the CancelledError asyncio raises in the coroutine it interrupts) is
        re-raised after that one line, for the command to exit with its status; a failed start is re-raised
        without a line (the command says why, with the server's log).
        """
        start = EngineStart(name, timeout_s, log_file)
        self._starts.append(start)
        try:
            yield start
        except (KeyboardInterrupt, asyncio.CancelledError):
            self._starts.remove(start)
            self.print(f"batchbench: interrupted while starting {name} ({start.timing()})")
            self.interrupted = True
            raise
        except BaseException:
            self._starts.remove(start)
            raise
        self._starts.remove(start)
        self.print(f"batchbench: {name} ready (started in {start.elapsed:.1f}s)")

    @contextmanager
    def run(self, total: int, label: str) -> Iterator[RunProgress]:
        """Shows one run under way; prints its line (:meth:`RunProgress.finish`, or its counts) when it ends."""
        bar = RunProgress(total, label)
        self._runs.append(bar)
        try:
            yield bar
        finally:
            self._runs.remove(bar)
        self.print(bar.line if bar.line is not None else f"{label}: {bar.counts()}")

    def sweep(self, i: int, n: int, label: str = "", *, left_s: float | None = None, extra: bool = False) -> None:
        """The sweep is at point ``i`` of the ``n`` planned (``left_s``: seconds left of its time limit, counted
        down live), or with ``extra`` at a repeat beyond the plan that the time allows, after point ``i``: shown
        live on a terminal, a line in a log. The total is the plan's and never grows as the sweep goes."""
        self._sweep = (i, n, label, extra)
        self._deadline = None if left_s is None else time.monotonic() + left_s
        if not self.live:
            left = f" ({_clock(left_s)} left)" if left_s is not None else ""
            self.print(f"batchbench: {_point(i, n, extra)}" + (f": {label}" if label else "") + left)
        else:
            self.refresh()


def _point(i: int, n: int, extra: bool) -> str:
    """``point 3 of 8``, or for a repeat beyond the plan ``extra repeat after point 3 of 8``."""
    return f"extra repeat after point {i} of {n}" if extra else f"point {i} of {n}"
