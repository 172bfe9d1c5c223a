"""The load generator's self-check: was the client itself the bottleneck?"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchbench.analysis import validity
from batchbench.core import codec
from batchbench.core.config import BatchingConfig, EngineDescription
from batchbench.core.records import RequestRecord
from batchbench.measures.client_load import (
    BURST_FRACTION,
    BURST_LAG_S,
    BUSY_LIMIT,
    LAG_PERCENTILES,
    MAX_BURST_SHARE,
    MAX_LOOP_LAG_S,
    ClientLoad,
    ClientMeter,
    read_bursts,
)
from batchbench.measures.metrics import Summary, summarize
from batchbench.reports.model import build_run
from batchbench.results import document as results
from batchbench.results.document import RunDocument, RunFooter, RunHeader
from batchbench.workload.requests import WorkloadSummary
from tests.cpu_quota_marks import NOT_UNDER_A_CPU_QUOTA


def client_notes(client: dict[str, object]) -> list[str]:
    """What the report says about a document whose footer has this ``client`` section."""
    header = RunHeader(run_id="r", engine=EngineDescription(engine="e", batching=BatchingConfig()),
        workload=WorkloadSummary(name="w", hash=""))
    raw = RunDocument(header=header, footer=RunFooter(status="complete")).to_dict() | {"client": client}
    return build_run("r.json", RunDocument.from_dict(raw)).notes


def spin(seconds: float) -> None:
    """Hold the loop's thread on the CPU for ``seconds`` of its own CPU time, as a flood of chunks to parse would
    (work, not wall time: on a shared core it takes longer, waiting for the CPU part of the time)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def test_a_loop_held_on_the_cpu_is_saturated() -> None:
    """Held for 0.3 s of its own CPU: busy, or (where other work took the CPU from it) late to wake."""
    with ClientMeter(probe_interval_s=0.01) as meter:
        for _ in range(6):
            await asyncio.sleep(0.001)
            end = time.thread_time() + 0.05
            while time.thread_time() < end:
                pass
    load = meter.result()
    assert load.cpu_s >= 0.25 and load.saturated and not load.contended
    assert load.busy_fraction >= BUSY_LIMIT or any(s.rule == "woke late" and s.own for s in load.symptoms())


async def test_an_idle_loop_is_not() -> None:
    with ClientMeter() as meter:
        await asyncio.sleep(0.3)
    load = meter.result()
    assert 0.25 <= load.wall_s < 1.0 and load.busy_fraction < 0.5 and not load.saturated


async def test_an_engine_computing_in_another_thread_is_not_client_load() -> None:
    """An engine computing in a worker thread of this process (a test's fake): its CPU is not the client's."""
    data = b"x" * (1 << 20)

    def compute() -> None:
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            hashlib.sha256(data).digest()  # releases the GIL, like torch kernels

    with ClientMeter() as meter:
        worker = threading.Thread(target=compute)
        worker.start()
        await asyncio.to_thread(worker.join)
    assert meter.result().busy_fraction < 0.5


def test_warnings_and_the_document() -> None:
    quiet = ClientLoad(0.1, 10.0, 0.01)
    assert quiet.warnings() == [] and client_notes(codec.encode(quiet)) == []
    busy = ClientLoad(9.5, 10.0, 0.95)
    symptom, account = busy.warnings()
    assert "busy 95%" in symptom and "limited the load" in symptom and account == "its loop was busy 95% of the run"
    doc = codec.encode(busy)
    assert doc["saturated"] and not doc["contended"]
    assert codec.decode(ClientLoad, doc) == busy and client_notes(doc) == busy.warnings()
    assert ClientLoad(8.0, 10.0, BUSY_LIMIT).saturated
    with pytest.raises(ValueError, match="'wall_s' is missing"):
        codec.decode(ClientLoad, {"cpu_s": 1.0})
    assert client_notes({"cpu_s": "x", "wall_s": 1, "busy_fraction": 0})[0].startswith("client load unreadable")


async def test_every_results_document_says_how_busy_the_client_was(tmp_path: Path) -> None:
    from batchbench.adapters.vllm import VLLMEngine
    from batchbench.core.config import ModelRef
    from batchbench.fixtures.protocol.vllm import VLLMServer
    from batchbench.load.runner import run
    from batchbench.workload.requests import Arrival, Lengths, WorkloadSpec

    server = VLLMServer(model="fake-model", token_delay=0.002, max_running=1024)
    await server.start_async()
    try:
        wl = WorkloadSpec("client", 8, prompt=Lengths.fixed(4), output=Lengths.fixed(16),
                          arrival=Arrival("closed", concurrency=4)).build()
        async with VLLMEngine(model=ModelRef("fake-model"), url=server.url) as engine:
            result = await run(engine, wl, results_dir=tmp_path)
    finally:
        await server.stop_async()
    doc = results.load(result.path)
    assert doc.footer is not None and doc.footer.client == result.client
    assert doc.to_dict()["client"] == codec.encode(result.client)
    assert 0 < result.client.wall_s <= result.duration_s + 0.05 and result.client.cpu_s > 0


# --------------------------------------------------------------------------- loop lag and read bursts


def stamped(times: list[float]) -> RequestRecord:
    return RequestRecord("r", 1, len(times), 0.0, chunk_times=list(times), chunk_tokens=[1] * len(times))


intervals = st.floats(min_value=1e-4, max_value=1.0)


@settings(deadline=None)  # a loaded 2-core machine stalls single examples
@given(start=st.floats(min_value=0, max_value=100), interval=intervals, n=st.integers(0, 200))
def test_evenly_spaced_chunks_are_no_bursts(start: float, interval: float, n: int) -> None:
    gaps, bursts = read_bursts([stamped([start + i * interval for i in range(n)])])
    assert bursts == 0 and gaps == (n - 1 if n >= 3 else 0)


@settings(deadline=None)  # a loaded 2-core machine stalls single examples
@given(interval=intervals, pairs=st.integers(2, 100), eps=st.floats(min_value=0, max_value=0.5 * BURST_FRACTION))
def test_chunks_read_in_pairs_are_half_bursts(interval: float, pairs: int, eps: float) -> None:
    """A client reading late takes two chunks of a stream in one go: every other gap is ~0, the others ~2x."""
    times = [t for k in range(pairs) for t in (2 * k * interval, (2 * k + eps) * interval)]
    gaps, bursts = read_bursts([stamped(times)])
    assert (gaps, bursts) == (2 * pairs - 1, pairs)


@settings(deadline=None)  # a loaded 2-core machine stalls single examples
@given(requests=st.lists(st.lists(st.floats(min_value=0, max_value=10), max_size=30), max_size=8),
       shift=st.floats(min_value=-5, max_value=5), scale=st.integers(-8, 8))
def test_bursts_are_counted_per_request_and_do_not_depend_on_the_clock(
        requests: list[list[float]], shift: float, scale: int) -> None:
    records = [stamped(sorted(times)) for times in requests]
    gaps, bursts = read_bursts(records)
    assert 0 <= bursts <= gaps == sum(len(t) - 1 for t in requests if len(t) >= 3)
    assert sum(read_bursts([r])[1] for r in records) == bursts
    # Scaling by a power of two is exact in floating point; a shift is exact on dyadic times.
    assert read_bursts([stamped([t * 2.0 ** scale for t in r.chunk_times]) for r in records]) == (gaps, bursts)
    dyadic = [stamped([round(t * 64) / 64 for t in r.chunk_times]) for r in records]
    shifted = [stamped([t + round(shift * 64) / 64 for t in r.chunk_times]) for r in dyadic]
    assert read_bursts(shifted) == read_bursts(dyadic)


def test_a_stream_stamped_at_one_instant_is_all_bursts() -> None:
    assert read_bursts([stamped([1.0] * 5)]) == (4, 4)


def test_the_lag_percentiles_follow_validitys_sample_rule() -> None:
    assert all(validity.samples_needed(q) == n for q, n in LAG_PERCENTILES)


async def test_a_held_loop_woke_late_and_the_run_is_invalid() -> None:
    """Its own 50 ms callbacks kept the loop late, and would have without any wait for a CPU: its own lag is
    over the limit however much other work shared its core (measured 40-45 ms, module docstring), and the
    verdict is "client saturated"."""
    with ClientMeter(probe_interval_s=0.01) as meter:
        for _ in range(6):
            await asyncio.sleep(0.005)
            spin(0.05)  # every probe due in the meantime waits for it
    load = meter.result()
    assert load.loop_lag_samples is not None and load.loop_lag_samples >= 4
    assert load.judged_lag is not None and load.judged_lag[1] > MAX_LOOP_LAG_S
    (woke,) = [s for s in load.symptoms() if s.rule == "woke late"]
    assert "chunk timestamps waited" in woke.text and woke.own and load.saturated and not load.contended
    assert load.own_lag is not None and load.own_lag[1] > MAX_LOOP_LAG_S and load.loop_wait_s is not None
    found = validity.check(_summary(), client=load, warmed_up=True)
    (reason,) = [r for r in found.why if woke.text in r.text]
    assert not found.valid and reason.kind == "client saturated"
    assert "the cause was the load generator's own work: its loop was busy" in reason.text


async def test_an_idle_loop_keeps_time() -> None:
    """The probe reports no lag of its own. Other work on a loaded machine can make any one try late (then
    rightly reported): one of three must keep time."""
    loads = []
    for _ in range(3):
        with ClientMeter(probe_interval_s=0.01) as meter:
            await asyncio.sleep(0.3)
        loads.append(load := meter.result())
        assert load.loop_lag_samples is not None and load.loop_lag_samples >= 4
        if load.judged_lag is not None and load.judged_lag[1] < MAX_LOOP_LAG_S and not load.saturated:
            return
    pytest.fail(f"an idle loop woke late in every try: {loads}")


def _summary() -> Summary:
    """One successful request: a run that is valid as far as its requests go."""
    record = stamped([0.1, 0.2, 0.3])
    record.ok, record.done_s = True, 0.3
    return summarize([record], duration_s=1.0)


def test_bursts_are_the_clients_only_when_its_loop_was_late() -> None:
    lagging = dict(loop_lag_samples=40, loop_lag_p50_s=0.001, loop_lag_p90_s=0.004, loop_lag_p99_s=0.02,
                   loop_lag_max_s=0.03)
    on_time = lagging | {"loop_lag_p90_s": 0.0005}
    bursty = dict(chunk_gaps=100, burst_gaps=int(100 * MAX_BURST_SHARE) + 1)
    client = ClientLoad(0.1, 1.0, 0.1, **lagging, **bursty)
    (reason,) = client.symptoms()
    assert reason.rule == "bursts" and "in bursts: 6%" in reason.text and "p90 of 40 probes" in reason.text
    assert client.notes() == []
    server = ClientLoad(0.1, 1.0, 0.1, **on_time, **bursty)
    (note,) = server.notes()
    assert server.symptoms() == [] and "the server delivered" in note
    assert validity.check(_summary(), client=server).valid and note in validity.check(_summary(), client=server).notes
    assert not validity.check(_summary(), client=client).valid
    calm = ClientLoad(0.1, 1.0, 0.1, **lagging, chunk_gaps=100, burst_gaps=int(100 * MAX_BURST_SHARE))
    assert calm.symptoms() == calm.notes() == []
    for load in (client, server, calm):
        assert codec.decode(ClientLoad, codec.encode(load)) == load


def test_documents_from_before_the_probe_still_read() -> None:
    old = {"cpu_s": 0.1, "wall_s": 1.0, "busy_fraction": 0.1, "saturated": False, "busy_limit": BUSY_LIMIT}
    load = codec.decode(ClientLoad, old)
    assert load.loop_lag_samples is None and load.burst_share is None and load.judged_lag is None
    assert load.loop_wait_s is None and load.own_lag is None
    assert client_notes(old) == []


# --------------------------------------------------------------------------- whose the lateness was

LAGGING = dict(loop_lag_samples=40, loop_lag_p50_s=0.001, loop_lag_p90_s=0.02, loop_lag_p99_s=0.03,
               loop_lag_max_s=0.03)


def test_a_late_loop_is_its_own_cause_when_busy_or_late_without_its_waits() -> None:
    """Busy past the limit decides alone; below it, the own lag: late beyond the limit even without the waits for
    a CPU is the loop's own work; late only by them is other work holding the CPU; without the accounts, busy
    alone (a late loop below the limit is then the machine's)."""
    busy = ClientLoad(0.9, 1.0, 0.9, **LAGGING, loop_wait_s=0.5, own_lag_p50_s=0.0, own_lag_p90_s=0.0,
                      own_lag_p99_s=0.0)
    own = ClientLoad(0.5, 1.0, 0.5, **LAGGING, loop_wait_s=0.2, own_lag_p50_s=0.001, own_lag_p90_s=0.012,
                     own_lag_p99_s=0.02)
    waiting = ClientLoad(0.1, 1.0, 0.1, **LAGGING, loop_wait_s=0.3, own_lag_p50_s=0.0002, own_lag_p90_s=0.0004,
                         own_lag_p99_s=0.0008)
    unaccounted = ClientLoad(0.1, 1.0, 0.1, **LAGGING)
    assert all(s.own for s in busy.symptoms()) and [s.rule for s in busy.symptoms()] == ["busy", "woke late"]
    assert own.saturated and not own.contended and own.own_lag == (90.0, 0.012)
    assert waiting.contended and not waiting.saturated
    assert unaccounted.contended and unaccounted.own_lag is None
    assert waiting.account() == ("its loop was busy 10% of the run and waited for a CPU 30% of it; had it never "
                                 "waited, it would have woken 0.4 ms late (p90)")
    assert unaccounted.account() == "its loop was busy 10% of the run"
    # Bursts while late are judged on the lower lag bound: an own lag of 3 ms made them, not of 0.4 ms.
    bursty = dict(chunk_gaps=100, burst_gaps=20)
    mild = dict(LAGGING, loop_lag_p90_s=0.004)
    assert [s.own for s in ClientLoad(0.1, 1.0, 0.1, **mild, **bursty, loop_wait_s=0.0, own_lag_p50_s=0.001,
                                      own_lag_p90_s=0.003, own_lag_p99_s=0.004).symptoms()] == [True]
    assert [s.own for s in ClientLoad(0.1, 1.0, 0.1, **mild, **bursty, loop_wait_s=0.1, own_lag_p50_s=0.0001,
                                      own_lag_p90_s=0.0004, own_lag_p99_s=0.001).symptoms()] == [False]
    for load in (busy, own, waiting):
        written = codec.encode(load)
        assert codec.decode(ClientLoad, written) == load and written["contended"] is load.contended


def test_workers_keep_the_late_loop_s_account_with_its_lag() -> None:
    late = ClientLoad(0.1, 1.0, 0.1, **LAGGING, loop_wait_s=0.3, own_lag_p50_s=0.0002, own_lag_p90_s=0.0004,
                      own_lag_p99_s=0.0008)
    quiet = ClientLoad(0.3, 1.2, 0.3, loop_lag_samples=40, loop_lag_p50_s=0.0005, loop_lag_p90_s=0.001,
                       loop_lag_p99_s=0.001, loop_lag_max_s=0.001, loop_wait_s=0.01, own_lag_p50_s=0.0005,
                       own_lag_p90_s=0.001, own_lag_p99_s=0.001)
    both = ClientLoad.combined([quiet, late])
    assert both.busy_fraction == 0.3 and both.loop_lag_p90_s == 0.02
    assert (both.loop_wait_s, both.own_lag_p90_s) == (0.3, 0.0004) and both.contended


#: Run in a child of its own, so that its niceness and CPU affinity go with it: its loop on ``cpu`` at the lowest
#: priority, idle for 0.8 s while other processes spin on that CPU; prints its client load.
IDLE_LOOP = """
import asyncio, json, os, sys
from batchbench.core import codec
from batchbench.measures.client_load import ClientMeter
os.sched_setaffinity(0, {int(sys.argv[1])})
os.nice(19)
async def idle():
    with ClientMeter(probe_interval_s=0.02) as meter:
        await asyncio.sleep(0.8)
    return meter.result()
print(json.dumps(codec.encode(asyncio.run(idle()))))
"""
#: A process spinning for at most 3 s (killed as soon as the measurement ends, about 1 s after it starts).
SPIN_BOUNDED = "import time\nend = time.time() + 3.0\nwhile time.time() < end: pass\n"


@NOT_UNDER_A_CPU_QUOTA
@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat") or not hasattr(os, "sched_setaffinity"),
                    reason="the run-queue accounts are Linux's")
def test_an_idle_loop_whose_cpu_others_hold_waited_and_is_contended_not_saturated() -> None:
    """A real measurement: an idle loop, niced behind processes spinning on its CPU, wakes late (52-77 ms at p50
    here) and had it never waited for a CPU it would have kept time: the verdict is contention, not the client's
    saturation. How late it wakes is the scheduler's to say: of three tries behind eight spinners, one must be
    late."""
    cpu = min(os.sched_getaffinity(0))
    tries = []
    for _ in range(3):
        load = _idle_loop_behind_spinners(cpu, 8)
        tries.append(load)
        assert load.busy_fraction < 0.2, load
        if load.own_lag is None:  # starved so long that fewer probes ran than a percentile needs: not judged
            continue
        # However late it woke, the waits were the lateness (own lag measured 0.2-0.3 ms).
        assert load.own_lag[1] < BURST_LAG_S, load
        assert load.loop_wait_s is not None, load
        if load.judged_lag is not None and load.judged_lag[1] > MAX_LOOP_LAG_S:
            assert load.loop_wait_s >= load.judged_lag[1], load  # a late try waited for its CPU at least that long
            assert load.contended and not load.saturated
            found = validity.check(_summary(), client=load, warmed_up=True)
            assert not found.valid and set(found.kinds) == {"machine contention"}, found.why
            assert "not the load generator's own work" in found.reasons[0]
            assert "waited for a CPU" in found.reasons[0]
            return
    pytest.fail(f"no try was judged late behind the spinners (each kept time or ran too few probes): {tries}")


def _idle_loop_behind_spinners(cpu: int, spinners: int) -> ClientLoad:
    """:data:`IDLE_LOOP` on ``cpu`` while ``spinners`` processes spin there."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN_BOUNDED]) for _ in range(spinners)]
    try:
        for proc in procs:
            os.sched_setaffinity(proc.pid, {cpu})
        time.sleep(0.2)  # started and spinning
        out = subprocess.run([sys.executable, "-c", IDLE_LOOP, str(cpu)], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return codec.decode(ClientLoad, json.loads(out))
