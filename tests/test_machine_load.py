"""The machine-load meter: who held the CPU during a run (the engine, the load generator, other processes, steal),
and what a run says about it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from batchbench.adapters.router import RoutedEngine
from batchbench.adapters.vllm import VLLMEngine
from batchbench.core import codec
from batchbench.core.config import BatchingConfig, EngineDescription, ModelRef
from batchbench.measures.machine_load import BUSY_SHARE, MachineLoad, MachineMeter
from batchbench.reports.model import build_run
from batchbench.results.document import RunDocument, RunFooter, RunHeader
from batchbench.workload.requests import WorkloadSummary
from tests.cpu_quota_marks import NOT_UNDER_A_CPU_QUOTA

pytestmark = pytest.mark.skipif(not os.path.isfile("/proc/stat"), reason="reads /proc (Linux only)")



def machine_notes(machine: dict[str, object]) -> list[str]:
    """What the report says about a document whose footer has this ``machine`` section."""
    header = RunHeader(run_id="r", engine=EngineDescription(engine="e", batching=BatchingConfig()),
        workload=WorkloadSummary(name="w", hash=""))
    raw = RunDocument(header=header, footer=RunFooter(status="complete")).to_dict() | {"machine": machine}
    return build_run("r.json", RunDocument.from_dict(raw)).notes


#: A process spinning for at most 3 s (each test kills its spinners as soon as it has measured, within ~1 s).
SPIN = "import time\nend = time.time() + 3\nwhile time.time() < end: pass\n"


@contextmanager
def spinners(count: int, *, new_session: bool = False) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=new_session) for _ in range(count)]
    try:
        time.sleep(0.2)  # started and spinning
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_process_spinning_every_core_is_a_disturbance() -> None:
    meter = MachineMeter(frozenset())
    with spinners(os.cpu_count() or 1):
        meter.start()
        time.sleep(0.6)
        load = meter.result()
    assert load.foreign_share is not None and load.foreign_share > BUSY_SHARE
    assert load.disturbed and "took" in load.warnings()[0]


def test_the_engine_server_and_this_process_are_not_foreign() -> None:
    with spinners(1, new_session=True) as (server,):
        own, server_pid = os.getpid(), server.pid
        launched = MachineMeter(frozenset({server_pid}))._processes()
        assert launched[own][0] == "client" and launched[server_pid][0] == "engine"
        # Without that launch, the same process is someone else's work.
        assert MachineMeter(frozenset())._processes()[server_pid][0] == "other"


@NOT_UNDER_A_CPU_QUOTA
def test_a_burner_in_the_engine_s_group_is_the_engine_s_and_one_outside_it_is_foreign() -> None:
    """A real measurement: two processes spinning for the same ~0.5 s, one in the process group passed as the
    engine's, one not. Each spins on one core at most: the engine's share is the first's, the other processes'
    share holds the second's, and the foreign share counts only the second."""
    with spinners(1, new_session=True) as (engine,), spinners(1, new_session=True):
        meter = MachineMeter(frozenset({engine.pid}))
        meter.start()
        time.sleep(0.5)
        load = meter.result()
    cpus = os.cpu_count() or 1
    assert load.cpus == cpus and load.engine_placement == "server processes"
    assert load.engine_share is not None and load.other_share is not None and load.steal_share is not None
    # One spinning process: at most one core, and on a machine shared with other work at least a quarter of it.
    assert 0.25 / cpus < load.engine_share <= 1.05 / cpus, load
    assert load.other_share > 0.25 / cpus, load
    assert load.foreign_share == pytest.approx(load.other_share + load.steal_share)
    assert load.client_share is not None and load.client_share < load.engine_share  # this test slept
    sentence = load.holders()
    assert sentence.startswith(f"the engine's server processes took {load.engine_share * cpus:.0%} of a core, "
                               f"other processes {load.other_share * cpus:.0%}"), sentence


class _LocalServer:
    """A local launch that already started its server (the process group leader ``pid``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def process_group(self) -> int:
        return self.pid


def test_an_engine_whose_processes_are_not_ours_has_no_foreign_share() -> None:
    """Its processes, if any run here, are among the others: no share is foreign for sure, so none is given (the
    run counts as quiet); who held the CPU is still measured, the engine among the others."""
    at_url = VLLMEngine(model=ModelRef("m"), url="http://gpu-host:8000")
    assert at_url.server_process_groups() is None
    meter = MachineMeter.for_engine(at_url)
    meter.start()
    time.sleep(0.05)  # a few clock ticks (none: nothing to divide by, nothing measured)
    load = meter.result()
    assert load.foreign_share is None and load.engine_share is None and load.engine_placement == "not ours"
    assert load.other_share is not None and load.client_share is not None and not load.disturbed
    assert load.holders().startswith("processes other than the load generator (the engine's among them")
    assert not MachineLoad(None).disturbed and MachineLoad(None).warnings() == []
    assert MachineLoad(None).holders() == "who held it was not measured"


def test_a_routed_layout_owns_every_pool_s_server() -> None:
    """Two local servers behind a router are the engine's own processes, not foreign load."""
    with spinners(2, new_session=True) as (first, second):
        pools = {route: VLLMEngine(model=ModelRef("m"), launch=_LocalServer(proc.pid))  # type: ignore[arg-type]
                 for route, proc in (("interactive", first), ("batch", second))}
        routed = RoutedEngine(pools, default="batch")
        assert routed.server_process_groups() == {first.pid, second.pid}
        meter = MachineMeter.for_engine(routed)
        assert meter.enabled and meter.placement == "server processes"
        holders = meter._processes()
        assert holders[first.pid][0] == holders[second.pid][0] == "engine" and holders[os.getpid()][0] == "client"
        # A single pool is measured the same way; the other pool's server is then someone else's work.
        assert MachineMeter.for_engine(pools["interactive"])._processes()[second.pid][0] == "other"
    # A pool whose processes are unknown (at a URL) makes the layout's unknown: no foreign share.
    mixed = RoutedEngine({"a": pools["batch"], "b": VLLMEngine(model=ModelRef("m"), url="http://gpu-host:8000")})
    assert mixed.server_process_groups() is None and MachineMeter.for_engine(mixed).placement == "not ours"


@pytest.mark.parametrize(("share", "disturbed"), [(0.0, False), (BUSY_SHARE, False), (0.26, True), (1.0, True)])
def test_the_report_notes_a_disturbed_run(share: float, disturbed: bool) -> None:
    doc = codec.encode(MachineLoad(share))
    assert doc["disturbed"] is disturbed
    assert codec.decode(MachineLoad, doc) == MachineLoad(share)
    notes = machine_notes(doc)
    assert (len(notes) == 1 and f"{share:.0%} of the machine's CPU" in notes[0]) if disturbed else notes == []


def test_a_malformed_machine_section_is_a_note_not_a_crash() -> None:
    assert machine_notes({"foreign_share": "lots"}) == [
        "machine load unreadable ('machine.foreign_share' is 'lots', not a number)"]


def test_old_machine_sections_read_with_only_their_foreign_share() -> None:
    old = {"foreign_share": 0.3, "disturbed": True, "busy_share": BUSY_SHARE}
    load = codec.decode(MachineLoad, old)
    assert load == MachineLoad(0.3) and load.disturbed and load.holders() == "who held it was not measured"
    assert machine_notes(old) == load.warnings()
    full = MachineLoad(0.02, engine_share=0.45, client_share=0.05, other_share=0.02, steal_share=0.0, cpus=2,
                       engine_placement="server processes", client_cpus=[1], client_cpus_busy=0.9,
                       client_cpus_foreign=0.7)
    assert codec.decode(MachineLoad, codec.encode(full)) == full
    for bad in ({"foreign_share": 0.1, "cpus": 1.5}, {"foreign_share": 0.1, "engine_placement": "elsewhere"},
                {"foreign_share": 0.1, "client_cpus": [0, "1"]}, {"foreign_share": 0.1, "engine_share": True}):
        with pytest.raises(ValueError, match=r"is .*, not "):
            codec.decode(MachineLoad, bad)


@NOT_UNDER_A_CPU_QUOTA  # a CPU the quota throttles is idle meanwhile, however many processes wait for it
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning to a subset needs two CPUs")
def test_the_pinned_load_generator_s_cpus_say_how_busy_they_were_and_with_whose_work() -> None:
    """A real measurement: this thread pinned to one CPU burns ~0.25 s of its own CPU there while a process
    pinned to the same CPU spins: the CPU is busy nearly all the time, the burner's part of it is other work
    than the load generator's, and this thread's part is the load generator's own."""
    before = os.sched_getaffinity(0)
    cpu = max(before)
    os.sched_setaffinity(0, {cpu})
    try:
        with spinners(1) as (burner,):
            os.sched_setaffinity(burner.pid, {cpu})
            meter = MachineMeter(frozenset())
            meter.start()
            end = time.thread_time() + 0.25
            while time.thread_time() < end:
                pass
            load = meter.result()
    finally:
        os.sched_setaffinity(0, before)
    assert meter.client_cpus == frozenset({cpu}) and load.client_cpus == [cpu]
    assert load.client_cpus_busy is not None and load.client_cpus_foreign is not None
    assert load.client_cpus_busy > 0.9, load  # two processes spinning on it
    own = load.client_cpus_busy - load.client_cpus_foreign
    # This thread had about half of it (0.25 s of CPU over ~0.5 s), the burner the rest.
    assert 0.2 < own < 0.8 and 0.2 < load.client_cpus_foreign < 0.8, load
    assert f"the load generator's CPU {cpu} was busy" in load.holders()
    # Not pinned (every CPU allowed): no client CPUs.
    unpinned = MachineMeter(frozenset())
    unpinned.start()
    time.sleep(0.05)
    assert unpinned.client_cpus is None and unpinned.result().client_cpus is None
