"""CPU placement: the default split and ``--cpus`` (hypothesis), the usage errors, and what is pinned where."""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.adapters.registry import EngineOptions
from batchbench.core.placement import (
    MAX_CPU,
    ONE_CPU,
    CpuPlacement,
    EngineCpus,
    PlacementError,
    default_placement,
    format_cpu_list,
    parse_cpu_list,
    parse_placement,
    usable_cpus,
)
from batchbench.experiment.harness import Harness
from batchbench.load.pinning import ClientPin, Pinned, affinity, current, pinned_process, placement_record
from batchbench.options import choose_placement, with_load_processes
from batchbench.workload.profiles import get_profile

cpu_sets = st.frozensets(st.integers(0, 300), min_size=1, max_size=40)
needs_two = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(usable_cpus()) < 2,
                               reason="needs CPU affinity and two usable CPUs")


# ----------------------------------------------------------------------------------- CPU lists


@given(cpu_sets)
def test_a_cpu_list_reads_back_as_it_was_written(cpus: frozenset[int]) -> None:
    text = format_cpu_list(cpus)
    assert parse_cpu_list(text) == cpus
    assert " " not in text and len(text.split(",")) <= len(cpus)  # runs are folded: 0-3, not 0,1,2,3


def test_the_list_forms_taskset_and_docker_take() -> None:
    assert parse_cpu_list("1") == {1}
    assert parse_cpu_list("0,2") == {0, 2}
    assert parse_cpu_list("1-3") == {1, 2, 3}
    assert format_cpu_list({5, 0, 1, 2}) == "0-2,5"


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "3-1", "1,,2", "1.5", f"0-{MAX_CPU}"])
def test_a_malformed_cpu_list_is_named(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        parse_cpu_list(text)


def test_vllm_reads_the_list_as_written() -> None:
    """The engine CPUs go to vLLM as VLLM_CPU_OMP_THREADS_BIND: its own parser must read our form."""
    cpu_resource_utils = pytest.importorskip("vllm.utils.cpu_resource_utils")
    for cpus in ({1}, {0, 2}, {1, 2, 3, 5}, {0, 1, 2, 3, 8, 9}):
        assert cpu_resource_utils.parse_id_list(format_cpu_list(cpus)) == sorted(cpus)


# ----------------------------------------------------------------------------------- the default split


@given(st.frozensets(st.integers(0, 300), min_size=2, max_size=64), st.integers(1, 80))
def test_the_default_gives_each_load_process_a_cpu_and_the_engine_the_rest(usable: frozenset[int],
                                                                           processes: int) -> None:
    placement = default_placement(usable, processes)
    assert placement is not None and placement.source == "default"
    clients = set(placement.client_cpus)
    assert not clients & placement.engine_cpus and clients | placement.engine_cpus == usable
    assert len(clients) == len(placement.client_cpus) == min(processes, len(usable) - 1)
    assert max(clients) < min(placement.engine_cpus)  # the lowest CPUs go to the load generator
    assert list(placement.client_cpus) == sorted(clients)
    assert placement.shared(processes) is (processes > len(clients))


@given(st.frozensets(st.integers(0, 300), max_size=1), st.integers(1, 8))
def test_one_cpu_has_nothing_to_split(usable: frozenset[int], processes: int) -> None:
    assert default_placement(usable, processes) is None


def test_two_cpus_client_on_0_engine_on_1() -> None:
    assert default_placement(frozenset({0, 1})) == CpuPlacement(frozenset({1}), (0,), "default")
    # A worker process each where there are cores, the engine keeping at least one.
    assert default_placement(frozenset(range(8)), 3) == CpuPlacement(frozenset(range(3, 8)), (0, 1, 2))
    assert default_placement(frozenset({0, 1}), 4) == CpuPlacement(frozenset({1}), (0,))


def test_workers_take_client_cpus_round_robin() -> None:
    placement = CpuPlacement(frozenset({3}), (0, 2))
    assert [placement.client_cpu(i) for i in range(5)] == [0, 2, 0, 2, 0]
    assert not placement.shared(2) and placement.shared(3)


@pytest.mark.parametrize(("engine", "client"), [(set(), (0,)), ({1}, ()), ({0, 1}, (1,))])
def test_a_placement_is_two_disjoint_sets(engine: set[int], client: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"at least one CPU for the engine and one|CPUs overlap"):
        CpuPlacement(frozenset(engine), client)


# ----------------------------------------------------------------------------------- --cpus


@given(st.frozensets(st.integers(0, 64), min_size=2, max_size=20), st.data())
def test_cpus_gives_exactly_the_sets_written(usable: frozenset[int], data: st.DataObject) -> None:
    ordered = sorted(usable)
    cut = data.draw(st.integers(1, len(ordered) - 1))
    shuffled = data.draw(st.permutations(ordered))
    engine, client = frozenset(shuffled[:cut]), frozenset(shuffled[cut:])
    for text in (f"engine={format_cpu_list(engine)},client={format_cpu_list(client)}",
                 f"client={','.join(map(str, sorted(client)))},engine={format_cpu_list(engine)}"):
        assert parse_placement(text, usable) == CpuPlacement(engine, tuple(sorted(client)), "--cpus")


@given(st.frozensets(st.integers(0, 64), min_size=1, max_size=20), st.frozensets(st.integers(0, 64), min_size=1,
                                                                                   max_size=20))
def test_cpus_that_overlap_or_are_not_ours_are_refused_by_name(engine: frozenset[int],
                                                                client: frozenset[int]) -> None:
    usable = frozenset(range(0, 64, 2))
    text = f"engine={format_cpu_list(engine)},client={format_cpu_list(client)}"
    if engine & client or not (engine | client) <= usable:
        with pytest.raises(PlacementError, match=f"--cpus '{text}'"):
            parse_placement(text, usable)
    else:
        assert parse_placement(text, usable) is not None


@pytest.mark.parametrize(("text", "why"), [
    ("engine=1", "client= is missing"),
    ("client=0", "engine= is missing"),
    ("engine=,client=0", "engine= names no CPU"),
    ("engine=1,client=1", "share CPU 1"),
    ("engine=0-1,client=1-2", "share CPU 1"),
    ("engine=a,client=0", "'a' is not a CPU number"),
    ("engine=3-1,client=0", "increasing range"),
    ("gpu=1,client=0", "unknown key 'gpu'"),
    ("engine=1,engine=2,client=0", "engine= is given twice"),
    ("1,2", "expected engine=LIST,client=LIST"),
    ("engine=7,client=0", "engine CPU 7 is not one this process may use"),
])
def test_a_bad_cpus_is_a_usage_error_naming_the_text(text: str, why: str) -> None:
    with pytest.raises(PlacementError) as info:
        parse_placement(text, frozenset({0, 1, 2}))
    assert f"--cpus {text!r}" in str(info.value) and why in str(info.value)


@pytest.mark.parametrize("text", ["none", "off", "None"])
def test_cpus_none_turns_placement_off(text: str) -> None:
    assert parse_placement(text, frozenset({0, 1})) is None
    assert choose_placement(text) == (None, f"turned off (--cpus {text})")


@needs_two
def test_the_front_ends_choose_a_default_placement() -> None:
    served, unplaced = choose_placement(None)
    assert served == default_placement(usable_cpus()) and unplaced is None
    # Worker processes: a client CPU each where there are CPUs to spare; a --cpus placement is kept.
    options = EngineOptions(placement=served)
    assert with_load_processes(options, None, 4).placement == default_placement(usable_cpus(), 4)
    assert with_load_processes(options, "engine=1,client=0", 4) is options


def test_one_cpu_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("batchbench.options.usable_cpus", lambda: frozenset({3}))
    assert choose_placement(None) == (None, ONE_CPU)


# ----------------------------------------------------------------------------------- the record


class _Placed:
    """An engine that says where it runs."""

    def __init__(self, where: EngineCpus) -> None:
        self.where = where

    def cpu_placement(self) -> EngineCpus:
        return self.where


PLACED = CpuPlacement(frozenset({1}), (0,), "--cpus")


@pytest.mark.parametrize(("engine", "pin", "workers", "applied", "reason"), [
    (EngineCpus("local process", frozenset({1})), ClientPin(PLACED), (), True, None),
    (EngineCpus("at a URL"), ClientPin(PLACED), (), True, None),
    (EngineCpus("local process", frozenset({0, 1}), "the OS refused"), ClientPin(PLACED), (), False,
     "engine: the OS refused"),
    (EngineCpus("container"), ClientPin(PLACED), (), False,
     "engine: launched without the placement, it runs anywhere, not on CPU 1"),
    (EngineCpus("local process", frozenset({1})), ClientPin(PLACED, refused="EPERM"), (), False,
     "load generator: EPERM"),
    (EngineCpus("local process", frozenset({1})), ClientPin(PLACED),
     (Pinned(frozenset({0})), Pinned(frozenset({0, 1}), "EINVAL")), False, "worker 1: EINVAL"),
    (EngineCpus("local process", frozenset({0, 1})), ClientPin(None, "one usable CPU"), (), False, "one usable CPU"),
    (EngineCpus("in process"), None, (), False, "no CPU placement was asked for"),
])
def test_the_record_says_what_was_applied_and_why_not(engine: EngineCpus, pin: ClientPin | None,
                                                      workers: tuple[Pinned, ...], applied: bool,
                                                      reason: str | None) -> None:
    record = placement_record(_Placed(engine), pin, workers)  # type: ignore[arg-type]
    assert record.applied is applied and record.reason == reason
    assert record.engine == engine.where
    assert record.engine_cpus == (sorted(engine.cpus) if engine.cpus is not None else None)
    assert record.client_cpus == [sorted(affinity()), *(sorted(w.cpus) for w in workers)]
    assert record.source == (pin.placement.source if pin is not None and pin.placement is not None else None)
    assert record.shared is (pin is not None and pin.placement is not None and len(workers) > 1)


# ----------------------------------------------------------------------------------- what is pinned


@pytest.fixture
def signals_kept() -> Iterator[None]:
    """The harness installs the launch registry's signal handlers; the test's process gets its own back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@needs_two
def test_the_harness_pins_its_loop_thread_and_not_the_tests_thread(signals_kept: None, tmp_path) -> None:
    before = os.sched_getaffinity(0)
    placement = default_placement(usable_cpus())
    assert placement is not None
    harness = Harness(EngineOptions(placement=placement), get_profile("quick"), tmp_path)
    try:
        async def on_the_loop() -> tuple[set[int], int, ClientPin | None]:
            return os.sched_getaffinity(0), threading.get_native_id(), current()

        loop_cpus, loop_tid, loop_pin = harness._loop.call(on_the_loop())
        assert loop_cpus == {placement.client_cpus[0]} and loop_tid != threading.get_native_id()
        assert loop_pin == harness.client_pin == ClientPin(placement)
        assert os.sched_getaffinity(0) == before and current() is None  # this thread: untouched
        with open(f"/proc/self/task/{loop_tid}/status") as status:
            assert f"Cpus_allowed_list:\t{placement.client_cpus[0]}\n" in status.read()
    finally:
        harness.close()


@needs_two
def test_the_cli_pins_every_thread_and_gives_the_cpus_back(signals_kept: None) -> None:
    before = os.sched_getaffinity(0)
    placement = CpuPlacement(frozenset({max(usable_cpus())}), (min(usable_cpus()),), "--cpus")
    started = threading.Event()
    release = threading.Event()
    seen: list[set[int]] = []

    def other() -> None:
        started.set()
        release.wait(10)
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=other)
    thread.start()
    started.wait(10)
    with pinned_process(EngineOptions(placement=placement)) as pin:
        assert pin == ClientPin(placement) and current() == pin
        assert os.sched_getaffinity(0) == {min(usable_cpus())}
        assert os.sched_getaffinity(thread.native_id) == {min(usable_cpus())}  # a thread that was already there
    release.set()
    thread.join()
    assert os.sched_getaffinity(0) == before and current() is None
    assert seen == [before]
