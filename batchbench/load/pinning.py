"""The load generator's share of a CPU placement: pin the measuring process (or thread), and record it all.

The engine's share is applied by its launch (:mod:`batchbench.core.placement`); this module applies
the client's, on the harness's side of the layers:

- the CLI's measuring commands pin the whole measuring process to the first client CPU before any engine
  starts (:func:`pinned_process`): every thread it has, and every thread and child it starts later, inherit it
  (a launched server sets its own CPUs before exec); when the command returns every thread gets its CPUs back
  (the CLI's own tests call it inside pytest's process);
- under pytest only the harness's event-loop thread is pinned, from inside it (:func:`pin_thread`), so the
  tests around it keep every CPU;
- each load-generator worker process pins itself to its own client CPU (:func:`pin_self`, from
  :mod:`batchbench.load.workers`).

What was done is kept per thread (:func:`current`), so a run on that thread records it:
:func:`placement_record` reads every share back from the OS for the results document's ``placement``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from batchbench.adapters.base import Engine
from batchbench.adapters.registry import EngineOptions
from batchbench.core.placement import CpuPlacement, can_pin, format_cpu_list
from batchbench.results.document import Placement

#: What the record says when nobody asked for a placement (a caller that built its own options, a bare run).
NOT_ASKED = "no CPU placement was asked for"


@dataclass(frozen=True)
class Pinned:
    """One load-generator process's CPUs, as read back after pinning; ``refused``: the OS's error, if any."""

    cpus: frozenset[int]
    refused: str | None = None


@dataclass(frozen=True)
class ClientPin:
    """What a front end did with the load generator's share of the session's placement."""

    placement: CpuPlacement | None
    #: Why there is no placement (the options' ``unplaced``).
    unplaced: str | None = None
    #: The OS's refusal to pin the measuring thread, if it refused.
    refused: str | None = None


_pins = threading.local()


def current() -> ClientPin | None:
    """What was pinned for the calling thread (None: nothing was asked on it)."""
    return getattr(_pins, "pin", None)


def affinity() -> frozenset[int]:
    """The calling thread's CPUs now (every CPU where the OS has no affinity)."""
    return frozenset(os.sched_getaffinity(0)) if can_pin() else frozenset(range(os.cpu_count() or 1))


def _refusal(cpus: frozenset[int], exc: OSError) -> str:
    return f"sched_setaffinity to CPU {format_cpu_list(cpus)} refused: {exc}"


def pin_self(cpu: int | None) -> Pinned:
    """The calling thread (and the threads and children it starts later) on ``cpu``; None: left as it is."""
    if cpu is None or not can_pin():
        return Pinned(affinity())
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError as exc:
        return Pinned(affinity(), _refusal(frozenset({cpu}), exc))
    return Pinned(affinity())


def _threads() -> list[int]:
    """This process's threads now (Linux lists them in /proc/self/task; elsewhere: the calling one, 0)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _every_thread(cpus: frozenset[int]) -> None:
    """Every thread this process has now on ``cpus``."""
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # it ended meanwhile
            continue


def _masks() -> dict[int, frozenset[int]]:
    """Each thread's CPUs now, to give back."""
    masks = {}
    for tid in _threads():
        try:
            masks[tid] = frozenset(os.sched_getaffinity(tid))
        except OSError:  # it ended meanwhile
            continue
    return masks


def _pin(options: EngineOptions, whole_process: bool) -> ClientPin:
    placement = options.placement
    refused = None
    if placement is not None and can_pin():
        cpus = frozenset({placement.client_cpu(0)})
        try:
            if whole_process:
                _every_thread(cpus)
            else:
                os.sched_setaffinity(0, cpus)
        except OSError as exc:
            refused = _refusal(cpus, exc)
    pin = ClientPin(placement, options.unplaced, refused)
    _pins.pin = pin
    return pin


@contextmanager
def pinned_process(options: EngineOptions) -> Iterator[ClientPin]:
    """The CLI's measuring process, all of it, on the placement's first client CPU (nothing without one) for the
    block; then every thread that was there gets its CPUs back, and this thread its earlier :func:`current`."""
    before, previous = (_masks() if can_pin() else {}), current()
    try:
        yield _pin(options, whole_process=True)
    finally:
        for tid, cpus in before.items():
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:  # it ended meanwhile
                continue
        _pins.pin = previous


def pin_thread(options: EngineOptions) -> ClientPin:
    """Only the calling thread (the harness's loop thread, from inside it) on the first client CPU."""
    return _pin(options, whole_process=False)


def placement_record(engine: Engine, pin: ClientPin | None, workers: Sequence[Pinned] = ()) -> Placement:
    """The results document's ``placement``: every share read back now, on the thread that measures.

    ``workers``: each load-generator worker process's CPUs as it reported them (none: the measuring process
    sends the load itself). ``applied`` holds when there is a placement and every share that is batchbench's
    to place runs where it was placed; an engine at a URL is not ours, and does not count against it.
    """
    placement = pin.placement if pin is not None else None
    engine_side = engine.cpu_placement()
    reasons: list[str] = []
    if placement is None:
        reasons.append(pin.unplaced if pin is not None and pin.unplaced else NOT_ASKED)
    else:
        if pin is not None and pin.refused:
            reasons.append(f"load generator: {pin.refused}")
        if engine_side.refused:
            reasons.append(f"engine: {engine_side.refused}")
        elif engine_side.where in ("local process", "container") and engine_side.cpus != placement.engine_cpus:
            on = f"on CPU {format_cpu_list(engine_side.cpus)}" if engine_side.cpus is not None else "anywhere"
            reasons.append(f"engine: launched without the placement, it runs {on}, not on CPU "
                           f"{format_cpu_list(placement.engine_cpus)}")
        elif engine_side.where == "in process":
            reasons.append("engine: it serves inside the measuring process, on the load generator's CPUs")
        reasons += [f"worker {i}: {w.refused}" for i, w in enumerate(workers) if w.refused]
    return Placement(
        source=placement.source if placement is not None else None,
        applied=placement is not None and not reasons,
        engine=engine_side.where,
        engine_cpus=sorted(engine_side.cpus) if engine_side.cpus is not None else None,
        client_cpus=[sorted(affinity()), *(sorted(w.cpus) for w in workers)],
        shared=placement is not None and placement.shared(len(workers)),
        reason="; ".join(reasons) or None,
    )
