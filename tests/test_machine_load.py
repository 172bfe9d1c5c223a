"""The machine-load meter: other processes' share of the CPU during a run, and what a run says about it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from batchbench.adapters.base import ModelRef
from batchbench.adapters.router import RoutedEngine
from batchbench.adapters.vllm import VLLMEngine
from batchbench.machine_load import BUSY_SHARE, MachineLoad, MachineMeter
from batchbench.reports.model import build_run
from batchbench.results import RunDocument, RunFooter, RunHeader

pytestmark = pytest.mark.skipif(not os.path.isfile("/proc/stat"), reason="reads /proc (Linux only)")



def machine_notes(machine: dict[str, object]) -> list[str]:
    """What the report says about a document whose footer has this ``machine`` section."""
    header = RunHeader(run_id="r", engine={"engine": "e", "batching": {}}, workload={"name": "w", "hash": ""})
    raw = RunDocument(header=header, footer=RunFooter(status="complete")).to_dict() | {"machine": machine}
    return build_run("r.json", RunDocument.from_dict(raw)).notes


SPIN = "import time\nend = time.time() + 30\nwhile time.time() < end: pass\n"


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
        launched = MachineMeter(frozenset({server_pid}))._others()
        assert own not in launched and server_pid not in launched
        # Without that launch, the same process is someone else's work.
        assert server_pid in MachineMeter(frozenset())._others()


class _LocalServer:
    """A local launch that already started its server (the process group leader ``pid``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def process_group(self) -> int:
        return self.pid


def test_an_engine_whose_processes_are_not_ours_is_not_measured() -> None:
    at_url = VLLMEngine(model=ModelRef("m"), url="http://gpu-host:8000")
    assert at_url.server_process_groups() is None
    meter = MachineMeter.for_engine(at_url)
    meter.start()
    assert meter.result() == MachineLoad(None)
    assert not MachineLoad(None).disturbed and MachineLoad(None).warnings() == []


def test_a_routed_layout_owns_every_pool_s_server() -> None:
    """Two local servers behind a router are the engine's own processes, not foreign load."""
    with spinners(2, new_session=True) as (first, second):
        pools = {route: VLLMEngine(model=ModelRef("m"), launch=_LocalServer(proc.pid))  # type: ignore[arg-type]
                 for route, proc in (("interactive", first), ("batch", second))}
        routed = RoutedEngine(pools, default="batch")
        assert routed.server_process_groups() == {first.pid, second.pid}
        meter = MachineMeter.for_engine(routed)
        assert meter.enabled
        others = meter._others()
        assert first.pid not in others and second.pid not in others and os.getpid() not in others
        # A single pool is measured the same way; the other pool's server is then someone else's work.
        assert second.pid in MachineMeter.for_engine(pools["interactive"])._others()
    # A pool whose processes are unknown (at a URL) makes the layout's unknown: nothing is measured.
    mixed = RoutedEngine({"a": pools["batch"], "b": VLLMEngine(model=ModelRef("m"), url="http://gpu-host:8000")})
    assert mixed.server_process_groups() is None and not MachineMeter.for_engine(mixed).enabled


@pytest.mark.parametrize("share, disturbed", [(0.0, False), (BUSY_SHARE, False), (0.26, True), (1.0, True)])
def test_the_report_notes_a_disturbed_run(share: float, disturbed: bool) -> None:
    doc = MachineLoad(share).to_dict()
    assert doc["disturbed"] is disturbed
    assert MachineLoad.from_dict(doc) == MachineLoad(share)
    notes = machine_notes(doc)
    assert (len(notes) == 1 and f"{share:.0%} of the machine's CPU" in notes[0]) if disturbed else notes == []


def test_a_malformed_machine_section_is_a_note_not_a_crash() -> None:
    assert machine_notes({"foreign_share": "lots"}) == [
        "machine load unreadable (not a machine-load document: foreign_share is 'lots')"]
