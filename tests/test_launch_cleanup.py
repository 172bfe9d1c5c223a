"""The cleanup registry: what this process started is stopped at exit and on fatal signals, once."""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from collections import Counter

import pytest

from batchbench.adapters.launch.cleanup import CleanupRegistry


def wait_for(condition, timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_teardown_stops_newest_first_and_reports_failures(registry: CleanupRegistry, capsys) -> None:
    stopped: list[str] = []

    def failing() -> None:
        raise OSError("daemon went away")

    registry.register("a", lambda: stopped.append("a"), "first")
    registry.register("b", failing, "broken")
    registry.register("c", lambda: stopped.append("c"), "third")
    registry.register("d", lambda: stopped.append("d"), "discarded")
    assert registry.discard("d") and not registry.discard("d")
    assert not registry.discard("never registered")
    assert "a" in registry and "d" not in registry and len(registry) == 3
    assert registry.names() == ["first", "broken", "third"]

    assert registry.teardown() == ["third", "first"]
    assert stopped == ["c", "a"]
    assert "could not stop broken: daemon went away" in capsys.readouterr().err
    assert len(registry) == 0 and registry.teardown() == []


def test_sigterm_tears_down_then_chains_to_the_previous_handler(registry: CleanupRegistry, capsys) -> None:
    received: list[int] = []
    order: list[str] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: (order.append("previous"), received.append(signum)))
    registry.install()
    assert signal.SIGTERM in registry.installed()
    registry.register("x", lambda: order.append("stopped"), "server x")

    os.kill(os.getpid(), signal.SIGTERM)
    assert wait_for(lambda: received)
    assert received == [signal.SIGTERM] and order == ["stopped", "previous"]
    assert len(registry) == 0
    assert "SIGTERM: stopped server x" in capsys.readouterr().err


def test_sighup_is_handled_like_sigterm(registry: CleanupRegistry) -> None:
    received: list[int] = []
    signal.signal(signal.SIGHUP, lambda signum, frame: received.append(signum))
    registry.install()
    stopped: list[str] = []
    registry.register("x", lambda: stopped.append("x"), "server x")
    os.kill(os.getpid(), signal.SIGHUP)
    assert wait_for(lambda: received)
    assert stopped == ["x"] and received == [signal.SIGHUP]


def test_sigint_still_raises_keyboard_interrupt(registry: CleanupRegistry) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    registry.install()
    stopped: list[str] = []
    registry.register("x", lambda: stopped.append("x"), "server x")
    with pytest.raises(KeyboardInterrupt):  # noqa: PT012 - raised by the handler during the sleep
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)  # the handler raises in this thread long before
    assert stopped == ["x"]


def test_an_ignored_signal_stays_ignored(registry: CleanupRegistry) -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
    registry.install()
    assert signal.SIGHUP not in registry.installed() and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    registry.register("x", lambda: None, "server x")
    os.kill(os.getpid(), signal.SIGHUP)
    time.sleep(0.05)
    assert "x" in registry


def test_a_second_signal_during_teardown_does_not_cut_it_short(registry: CleanupRegistry) -> None:
    received: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    registry.install()
    stopped: list[str] = []

    def impatient() -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the first one is being handled
        time.sleep(0.05)
        stopped.append("impatient")

    registry.register("a", lambda: stopped.append("a"), "a")
    registry.register("b", impatient, "b")
    os.kill(os.getpid(), signal.SIGTERM)
    assert wait_for(lambda: received)
    time.sleep(0.05)
    assert stopped == ["impatient", "a"]
    assert received == [signal.SIGTERM]  # the previous handler ran once, after the whole teardown


def test_uninstall_puts_the_handlers_back(registry: CleanupRegistry) -> None:
    def mine(signum, frame) -> None:
        pass

    signal.signal(signal.SIGTERM, mine)
    registry.install()
    registry.install()  # idempotent: the previous handler is not our own
    assert signal.getsignal(signal.SIGTERM) == registry._on_signal
    registry.uninstall()
    assert signal.getsignal(signal.SIGTERM) is mine
    assert registry.installed() == set()


def test_from_another_thread_only_the_exit_hook(registry: CleanupRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    hooks: list[object] = []
    monkeypatch.setattr(atexit, "register", hooks.append)
    before = signal.getsignal(signal.SIGTERM)
    worker = threading.Thread(target=registry.install)
    worker.start()
    worker.join()
    assert hooks == [registry.teardown]
    assert registry.installed() == set() and signal.getsignal(signal.SIGTERM) is before
    registry.install()  # later, from the main thread: the handlers too, the exit hook still once
    assert hooks == [registry.teardown]
    assert signal.SIGTERM in registry.installed() and signal.getsignal(signal.SIGTERM) == registry._on_signal


def test_concurrent_registration_and_teardown_stop_each_thing_once(registry: CleanupRegistry) -> None:
    stops: Counter[tuple[int, int]] = Counter()
    lock = threading.Lock()

    def stopper(key: tuple[int, int]):
        def stop() -> None:
            with lock:
                stops[key] += 1
        return stop

    def churn(worker: int) -> None:
        for i in range(300):
            key = (worker, i)
            registry.register(key, stopper(key), f"{worker}-{i}")
            if i % 3 == 0 and registry.discard(key):
                with lock:
                    stops[key] += 1  # stopped by its owner before any teardown got to it

    threads = [threading.Thread(target=churn, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        registry.teardown()
    for t in threads:
        t.join()
    registry.teardown()
    assert len(stops) == 6 * 300 and set(stops.values()) == {1}
