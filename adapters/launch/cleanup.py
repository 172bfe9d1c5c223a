"""One registry of what this process started and must not leave behind.

Local server process groups and containers register a stop callback when they
start and withdraw it when they are stopped normally. Whatever is still
registered is stopped:

- at interpreter exit (atexit);
- on SIGTERM and SIGHUP, after which the process exits as the signal's default
  action would have it (it re-raises the signal: the parent sees "killed by
  SIGTERM", a shell reports 128+signum);
- on SIGINT, after which Python's KeyboardInterrupt is raised as usual.

A handler that was installed before :meth:`CleanupRegistry.install` still runs
after the teardown (chained); a signal that was ignored (``nohup``) stays
ignored. Signal handlers can only be installed from the main thread; called
from another thread, :meth:`~CleanupRegistry.install` registers the exit hook
only, and a later call from the main thread adds the handlers. A SIGKILLed
process leaves its servers running: containers are found again by their labels
(``python -m batchbench.adapters.launch cleanup``).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from types import FrameType
from typing import Any

#: The signals whose default action would kill this process and leave its servers running.
SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class _Entry:
    name: str
    stop: Callable[[], None]


class CleanupRegistry:
    """What this process started and has not stopped yet; stopped at exit and on fatal signals."""

    def __init__(self, signals: tuple[signal.Signals, ...] = SIGNALS, *, defer_to_handlers: bool = False) -> None:
        """``defer_to_handlers``: where a signal's previous handler is Python code (the CLI's SIGTERM handler, which
        finishes the command as Ctrl-C does), chain to it without tearing down first: that unwinding stops what
        was started in order (a Ray pool's workers send back their last records), and the exit hook stops
        whatever it leaves."""
        self.signals = signals
        self.defer_to_handlers = defer_to_handlers
        self._entries: dict[Hashable, _Entry] = {}
        # Reentrant: a signal handler runs in the main thread, possibly while it holds the lock.
        self._lock = threading.RLock()
        self._at_exit = False
        self._previous: dict[int, Any] = {}
        self._handling = False
        self._deferred: list[int] = []

    # ---- what is live

    def register(self, key: Hashable, stop: Callable[[], None], name: str) -> None:
        """Stop ``key`` with ``stop()`` at exit or on a fatal signal unless it is discarded first.

        ``stop`` runs in whatever thread tears down (the main thread for a signal) and
        must not need an event loop; an exception it raises is reported, not propagated.
        """
        with self._lock:
            self._entries[key] = _Entry(name, stop)

    def discard(self, key: Hashable) -> bool:
        """``key`` was stopped (or is gone): nothing to do for it any more.

        False when it was not registered (any more): a teardown may have stopped it already.
        """
        with self._lock:
            return self._entries.pop(key, None) is not None

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def names(self) -> list[str]:
        with self._lock:
            return [entry.name for entry in self._entries.values()]

    def teardown(self) -> list[str]:
        """Stop everything registered, newest first; return the names of what was stopped."""
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        stopped = []
        for entry in reversed(entries):
            try:
                entry.stop()
            except Exception as exc:
                print(f"batchbench: could not stop {entry.name}: {exc}", file=sys.stderr)
            else:
                stopped.append(entry.name)
        return stopped

    # ---- hooks

    def install(self) -> None:
        """Register the exit hook, and the signal handlers when called from the main thread (idempotent)."""
        with self._lock:
            if not self._at_exit:
                atexit.register(self.teardown)
                self._at_exit = True
            if threading.current_thread() is not threading.main_thread():
                return
            for sig in self.signals:
                if sig in self._previous:
                    continue
                try:
                    previous = signal.getsignal(sig)
                    if previous == signal.SIG_IGN:
                        continue  # e.g. SIGHUP under nohup: the user asked for it not to end the run
                    signal.signal(sig, self._on_signal)
                except (ValueError, OSError):  # pragma: no cover - not the main interpreter
                    continue
                self._previous[sig] = previous

    def uninstall(self) -> None:
        """Put back the handlers :meth:`install` replaced and drop the exit hook (tests)."""
        with self._lock:
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            self._previous.clear()
            if self._at_exit:
                atexit.unregister(self.teardown)
                self._at_exit = False

    def installed(self) -> set[int]:
        """The signals whose handler this registry installed."""
        with self._lock:
            return set(self._previous)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.defer_to_handlers and callable(self._previous.get(signum)):
            self._chain(signum, frame)
            return
        if self._handling:
            # A second signal while tearing down (an impatient Ctrl-C): finish the teardown first.
            self._deferred.append(signum)
            return
        self._handling = True
        try:
            if len(self):
                names = self.teardown()
                print(f"batchbench: {signal.Signals(signum).name}: stopped {', '.join(names) or 'nothing'}",
                      file=sys.stderr)
        finally:
            self._handling = False
            self._deferred.clear()
        self._chain(signum, frame)

    def _chain(self, signum: int, frame: FrameType | None) -> None:
        """What would have happened without this registry."""
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)  # e.g. default_int_handler: KeyboardInterrupt
        elif previous == signal.SIG_IGN:  # pragma: no cover - install() leaves ignored signals alone
            return
        else:
            # The default action (SIG_DFL, or a handler Python did not install): die of the signal.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


#: The registry of this process: every launch registers here unless given another one.
REGISTRY = CleanupRegistry()
