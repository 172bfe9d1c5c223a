"""The results document: one versioned JSON file per run, written as the run goes.

The document is typed: a :class:`RunHeader` (what was run, where, how), the
run's :class:`~batchbench.core.records.RequestRecord` list and
:class:`~batchbench.core.server_metrics.ServerMetrics` samples, and a
:class:`RunFooter` (how it ended and what it measured), together a
:class:`RunDocument`. This module is the only place that knows how they are
laid out on disk; everything else reads and writes the types.

While a run is in progress every record and server-metrics sample is appended
to a journal (``<name>.jsonl``, one JSON object a line) by a writer thread, off
the measuring event loop (encoding a record and a flush that waits for a busy
disk would delay the timestamps of every chunk behind them). It writes and
flushes whatever was handed to it while it wrote the last batch, and closing
the writer (the runner does it however the run ends) writes everything handed
over first, so an exception or Ctrl-C loses nothing already measured; a process
killed outright (SIGKILL) loses only what the thread had not written yet,
normally well under a millisecond of records. When the run ends,
normally or not, :class:`JournalWriter` folds the journal into the final
``<name>.json`` document (atomically) and removes it. :meth:`RunDocument.load`
reads either, so a journal left by a killed harness is still a usable result
(status ``"partial"``, no footer).

On disk the document is one flat JSON object: ``schema``, ``schema_version``,
the header's keys, ``records``, ``server_metrics``, ``gpu_samples``, then the footer's keys
(a partial document has ``"status": "partial"`` and no other footer key).
``python -m batchbench.results schema`` prints its JSON Schema.

Versions. ``schema_version`` is the major version: it changes when a key
changes meaning or type, or goes away; this reader refuses a newer one.
Additive changes (a new key) keep the major version, and this reader ignores
keys it does not know. Version 2 had the layout of version 1; what changed is
that every header and footer key is written (null where there is nothing to
say: v1 documents could lack ``summary.mean_decoding``, ``load``'s
``scrape_interval_s``, the footer's ``guardrails``, ``client`` and
``machine``), ``guardrails`` has a fixed set of keys (:class:`Guardrails`), and
the layout is published as a JSON Schema. Version 3 writes the header's
``slo`` as the objectives themselves (:class:`batchbench.measures.slo.Slo`,
``{"ttft_p99": 0.5}``), not the per-request limits they give, and ``load`` as
the load generator's own :class:`~batchbench.core.config.LoadConfig`. Version 4
(this one) names a request's LoRA ``lora`` (``adapter`` before: one word meant
both an engine adapter and a LoRA), the summary's per-LoRA figures ``loras``
and ``lora_fairness``, and a sample's ``loras_active``. Versions 1 to 3 are read: a missing key that may be null
reads as null (not recorded), any other missing key takes its default, a key
renamed since is read under its old name, and a v2 ``slo`` reads as max
objectives on its limits (the same goodput).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import queue
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

try:  # writes a record's line several times faster than json; optional
    import orjson
except ImportError:  # pragma: no cover - exercised where orjson is not installed
    orjson = None  # type: ignore[assignment]

from batchbench.core import codec
from batchbench.core.config import BatchingConfig, EngineDescription, LoadConfig, field_doc
from batchbench.core.placement import EngineWhere, PlacementSource
from batchbench.core.records import RequestRecord
from batchbench.core.server_metrics import ServerMetrics
from batchbench.measures.client_load import ClientLoad
from batchbench.measures.gpu import GpuSample, GpuSelection, GpuTelemetry
from batchbench.measures.guardrails import Guardrails, server_summary
from batchbench.measures.machine_load import MachineLoad
from batchbench.measures.metrics import Summary
from batchbench.measures.slices import Slice
from batchbench.measures.slo import Slo
from batchbench.results.claims import CLAIMS_FILE
from batchbench.workload.requests import WorkloadSummary

SCHEMA = "batchbench.results"
SCHEMA_VERSION = 4
#: Journal entry types, one per line: the header first, the footer last when the run ended at all.
ENTRY_TYPES = ("header", "record", "sample", "gpu_sample", "footer")


class DocumentError(codec.DecodeError):
    """A results document (or journal) that cannot be read: malformed, or from a newer batchbench."""


class NotAResultsDocument(DocumentError):
    """A JSON or JSONL file that is not a batchbench results document at all (someone else's file)."""


# --------------------------------------------------------------------------- the document's types


@dataclass(frozen=True)
class ScrapeStats:
    """How the server-metrics scraper fared."""

    failures: int = 0
    last_error: str | None = None
    #: Scrapes made during the run (its end included), and their mean wall time seen from the client.
    scrapes: int | None = None
    mean_scrape_s: float | None = None


@dataclass(frozen=True)
class Placement:
    """Which CPUs the engine and the load generator ran on, read back from the OS as the run started."""

    source: PlacementSource | None = field(default=None, metadata=field_doc(
        "where the placement came from: batchbench's default split or --cpus; null: no placement (--cpus none, "
        "one usable CPU, an engine serving in process, or none asked for: see reason)"))
    applied: bool = field(default=False, metadata=field_doc(
        "there was a placement and every share that was batchbench's to place runs where it was placed (an "
        "engine at a URL is not ours, and does not count against it)"))
    engine: EngineWhere = field(default="not known", metadata=field_doc("where the engine runs"))
    engine_cpus: list[int] | None = field(default=None, metadata=field_doc(
        "the CPUs the engine's server runs on: a local process's affinity read back, a container's cpuset; null "
        "where batchbench did not place it or cannot see it"))
    client_cpus: list[list[int]] = field(default_factory=list, metadata=field_doc(
        "the CPUs of each load-generator process, read back: the measuring thread first, then each worker "
        "process (worker 0 shares the first client CPU with the measuring process, which only collects then)"))
    shared: bool = field(default=False, metadata=field_doc(
        "worker processes shared client CPUs (more workers than client CPUs)"))
    reason: str | None = field(default=None, metadata=field_doc(
        "why it was not applied, in full: no placement and why, or where the OS refused (its error)"))


def _slo_or_none(slo: Slo) -> Slo | None:
    """No objectives is no SLO (a version-2 document's ``{"ttft_s": null, "tpot_s": null}``)."""
    return slo if slo.objectives else None


def _label(text: str) -> dict[str, Any]:
    """A label's metadata: labels are free-form, so one of another type than batchbench gives it reads as null."""
    return field_doc(text, lenient=True)


@dataclass(frozen=True, kw_only=True)
class RunLabels:
    """What the run was part of, as the command or suite that ran it says: the keys findings and the report group
    and judge by typed, then any other label (a suite's own), flat beside them."""

    suite: str | None = field(default=None, metadata=_label("the suite or command that ran it ('main': run)"))
    profile: str | None = field(default=None, metadata=_label("the workload profile (quick, full)"))
    layout: str | None = field(default=None, metadata=_label(
        "how the batch was formed: 'continuous' (a closed loop), 'static-waves', ..."))
    concurrency: int | None = field(default=None, metadata=_label("the batch size (closed-loop concurrency)"))
    repeat: int | None = field(default=None, metadata=_label("which repetition of its point"))
    warmed_up: bool | None = field(default=None, metadata=_label(
        "the engine was warmed up with the run's shapes before it (false or null: measured cold)"))
    precision: float | None = field(default=None, metadata=_label(
        "the precision target its point was repeated for (half-width of the 95% interval, as a share)"))
    time_limit_s: float | None = field(default=None, metadata=_label(
        "the whole job's wall-clock bound its repeats were fitted into (batchbench run --time-limit)"))
    kv_fit: int | None = field(default=None, metadata=_label(
        "the batch size the KV cache was sized to fit (the memory-bound regime starts above it)"))
    kv_capacity_tokens: int | None = field(default=None, metadata=_label("the KV cache's size the run asked for"))
    design: dict[str, Any] | None = field(default=None, metadata=_label("the main job's sweep design"))
    others: dict[str, Any] = field(default_factory=dict, metadata={"rest": True})

    @classmethod
    def of(cls, labels: dict[str, Any] | None) -> RunLabels:
        """Labels given as a mapping (a suite's), typed."""
        return codec.decode(cls, codec.encode(labels or {}), "labels")

    def given(self) -> dict[str, Any]:
        """The labels the run was given (null ones left out), typed ones first."""
        return {k: v for k, v in codec.encode(self).items() if v is not None}


@dataclass(frozen=True, kw_only=True)
class RunHeader:
    """What was run, where and how: written before the first request."""

    run_id: str
    started_at: str | None = None
    engine: EngineDescription = field(metadata=field_doc("the engine as its adapter describes itself "
                                                         "(Engine.describe)"))
    workload: WorkloadSummary = field(metadata=field_doc("the workload as it describes itself (Workload.describe)"))
    load: LoadConfig = field(default_factory=LoadConfig)
    slo: Slo | None = field(default=None, metadata=field_doc(
        "the service-level objectives the run's goodput counted requests against ({\"ttft_p99\": 0.5}: seconds by "
        "objective; version 2 wrote the per-request limits as {\"ttft_s\", \"tpot_s\"}, read as max objectives); "
        "null: none", reader=lambda doc: _slo_or_none(Slo.from_dict(doc)), unreadable="slo"))
    environment: dict[str, Any] = field(default_factory=dict, metadata=field_doc(
        "machine, accelerators, package versions and commit (batchbench.core.environment.capture)"))
    labels: RunLabels = field(default_factory=RunLabels, metadata=field_doc("what the run was part of"))
    cache_reset: bool | None = field(default=None, metadata=field_doc(
        "whether the engine's prefix cache was emptied before the run (Engine.reset_cache): false when it has "
        "nothing to reset or no way to, null when not asked"))
    placement: Placement | None = field(default=None, metadata=field_doc(
        "which CPUs the engine and the load generator ran on (batchbench.load.pinning); null: not recorded (an "
        "older document)"))
    gpus: GpuSelection | None = field(default=None, metadata=field_doc(
        "which GPUs the run's telemetry samples and why (the engine's CUDA_VISIBLE_DEVICES or container --gpus, "
        "else every visible GPU), or why none is (\"no NVML: ...\"); null: not recorded (an older document)"))

    @property
    def engine_name(self) -> str:
        return self.engine.engine

    @property
    def batching(self) -> BatchingConfig | None:
        """The engine's batching config (None: one this version could not read)."""
        return self.engine.batching

    @property
    def batching_label(self) -> str:
        """The batching config's label (BatchingConfig.label), as result file names and report keys carry it."""
        return self.engine.batching_label

    @property
    def workload_name(self) -> str:
        return self.workload.name

    @property
    def workload_hash(self) -> str:
        return self.workload.hash

    @property
    def closed_loop(self) -> bool:
        """Whether the run's workload was sent as a closed loop of single requests (it has a steady state)."""
        return self.workload.closed_loop


@dataclass(frozen=True, kw_only=True)
class WorkerReport:
    """One load-generator worker of a run sent from several (``batchbench.load.workers``) or from Ray
    (``batchbench.load.ray_workers``): where it ran, how its clock and start compared with the driver's, what it
    cost, and whether it was lost."""

    index: int = field(metadata=field_doc("its place in the partition (worker i sends part i)"))
    pool: Literal["processes", "ray"] = field(metadata=field_doc(
        "local processes (--workers N) or Ray actors (--workers ray:N)"))
    host: str = field(metadata=field_doc("the host name it ran on"))
    node: str | None = field(default=None, metadata=field_doc("its Ray node's id; null: a local process"))
    pid: int | None = None
    cpus: list[int] | None = field(default=None, metadata=field_doc("the CPUs it ran on, read back; null: not known"))
    requests: int = field(default=0, metadata=field_doc("requests of its part"))
    records: int = field(default=0, metadata=field_doc("records it delivered (those of a lost worker's unfinished "
                                                        "requests are the driver's, error_kind worker_died)"))
    clock_offset_s: float | None = field(default=None, metadata=field_doc(
        "its wall clock minus the driver's, from the round trip of least delay (NTP's estimate); only the start "
        "instant depends on it: each latency is a duration on the sender's own monotonic clock. Null: the "
        "driver's host (one clock)"))
    clock_rtt_s: float | None = field(default=None, metadata=field_doc(
        "that round trip's time: the offset is known to within half of it"))
    start_late_s: float | None = field(default=None, metadata=field_doc(
        "how long after the agreed start instant its load generator began, on its own clock"))
    cpu_s: float | None = field(default=None, metadata=field_doc(
        "its whole process's CPU time over the run (the load generator's loop, record delivery, the Ray core "
        "worker's threads); the loop's own is client.cpu_s"))
    client: ClientLoad | None = field(default=None, metadata={"unreadable": "worker client load"})
    lost: str | None = field(default=None, metadata=field_doc("why it was lost mid-run; null: it finished"))
    lost_at_s: float | None = field(default=None, metadata=field_doc("when the driver saw it lost, from the start"))


@dataclass(frozen=True, kw_only=True)
class RunFooter:
    """How a run ended and what it measured: written once, when it ends (absent from a killed run's journal)."""

    status: str = field(metadata=field_doc("'complete' or 'interrupted' ('partial' is a document without a footer)",
                                      schema={"not": {"const": "partial"}}))
    error: str | None = field(default=None, metadata=field_doc("why an interrupted run stopped"))
    finished_at: str | None = None
    duration_s: float | None = field(default=None, metadata=field_doc("wall-clock length; throughputs divide by it"))
    engine_report: dict[str, Any] = field(default_factory=dict, metadata=field_doc(
        "engine-side accounting since the run began (Engine.report), e.g. padding of a static batcher"))
    scrape: ScrapeStats = field(default_factory=ScrapeStats)
    summary: Summary | None = field(default=None,
                                    metadata=field_doc("batchbench.measures.metrics.summarize over the records"))
    guardrails: Guardrails | None = field(default=None, metadata=field_doc(
        "batchbench.measures.guardrails.server_summary over the server metrics"))
    client: ClientLoad | None = field(default=None, metadata={"unreadable": "client load"})
    machine: MachineLoad | None = field(default=None, metadata={"unreadable": "machine load"})
    gpu: GpuTelemetry | None = field(default=None, metadata=field_doc(
        "what the sampled GPUs did over the run (batchbench.measures.gpu): energy, power, utilisation, memory, "
        "clocks, or why there are no figures; null: not recorded (an older document)"))
    slices: list[Slice] = field(default_factory=list, metadata=field_doc(
        "the run's metrics over windows of LoadConfig.slice_s (batchbench.measures.slices); empty: not sliced"))
    stages: list[Slice] = field(default_factory=list, metadata=field_doc(
        "a staged load's stages, each its own window (the last one's runs to the run's end); empty: not staged"))
    workers: list[WorkerReport] = field(default_factory=list, metadata=field_doc(
        "each load-generator worker, when the run was sent from several or from Ray; empty: this process alone"))


@dataclass(kw_only=True)
class RunDocument:
    """One run's results: header, every request record and server sample, and the footer (None: partial)."""

    header: RunHeader
    records: list[RequestRecord] = field(default_factory=list)
    server_metrics: list[ServerMetrics] = field(default_factory=list)
    #: The GPU telemetry's samples (:mod:`batchbench.measures.gpu`), every sampled GPU at each moment.
    gpu_samples: list[GpuSample] = field(default_factory=list)
    footer: RunFooter | None = None
    #: The schema version the document was read from (written documents are always :data:`SCHEMA_VERSION`).
    read_version: int = field(default=SCHEMA_VERSION, compare=False, repr=False)
    #: Sections that could not be read and were left out (e.g. "machine load unreadable (...)").
    problems: list[str] = field(default_factory=list, compare=False, repr=False)

    @property
    def status(self) -> str:
        return self.footer.status if self.footer is not None else "partial"

    @property
    def partial(self) -> bool:
        """No footer: a journal left by a run that was killed before it could finish."""
        return self.footer is None

    def observed_duration_s(self) -> float:
        """How long the run lasted as far as its records and samples show (their last timestamp): the duration
        of a journal cut short, which has no footer to say."""
        times: list[float] = [0.0]
        for r in self.records:
            times.extend(t for t in (r.sent_s, r.done_s, *(r.chunk_times[-1:])) if t is not None)
        times.extend(s.t for s in self.server_metrics)
        return max(times)

    def guardrails(self) -> Guardrails:
        """The stored guardrails; for a partial run (or a v1 document without them), computed from the samples
        with the runner's own :func:`batchbench.measures.guardrails.server_summary`."""
        if self.footer is not None and self.footer.guardrails is not None:
            return self.footer.guardrails
        return server_summary(self.server_metrics)

    # ---- JSON

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, **codec.encode_fields(self.header),
                               "records": [codec.encode(r) for r in self.records],
                               "server_metrics": [codec.encode(s) for s in self.server_metrics],
                               "gpu_samples": [codec.encode(s) for s in self.gpu_samples]}
        doc.update(codec.encode_fields(self.footer) if self.footer is not None else {"status": "partial"})
        return doc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, doc: Any) -> RunDocument:
        """Read a document (any version up to :data:`SCHEMA_VERSION`); :class:`DocumentError` if it cannot be."""
        schema = doc.get("schema") if isinstance(doc, dict) else None
        if schema != SCHEMA:
            raise NotAResultsDocument(f"is not a batchbench results document (schema {schema!r})")
        version = doc.get("schema_version", 1)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise DocumentError(f"'schema_version' is {version!r}, not a version number")
        if version > SCHEMA_VERSION:
            raise DocumentError(f"has schema version {version}; this batchbench reads {SCHEMA_VERSION} and older "
                                "(a newer batchbench wrote it: upgrade to read it)")
        problems: list[str] = []
        try:
            header = codec.decode(RunHeader, doc, "", problems)
            records = codec.decode(list[RequestRecord], doc.get("records", []), "records", problems)
            samples = codec.decode(list[ServerMetrics], doc.get("server_metrics", []), "server_metrics", problems)
            gpu_samples = codec.decode(list[GpuSample], doc.get("gpu_samples", []), "gpu_samples", problems)
            status = doc.get("status")
            footer = None if status is None or status == "partial" else codec.decode(RunFooter, doc, "", problems)
        except codec.DecodeError as exc:
            raise DocumentError(str(exc)) from None
        return cls(header=header, records=records, server_metrics=samples, gpu_samples=gpu_samples, footer=footer,
                   read_version=version, problems=problems)

    @classmethod
    def from_json(cls, text: str) -> RunDocument:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RunDocument:
        """Read a finished ``.json`` document, or fold the ``.jsonl`` journal a killed run left behind.

        ``run.json`` that does not exist next to an existing ``run.jsonl`` reads the journal. Raises
        :class:`NotAResultsDocument` for someone else's JSON, :class:`DocumentError` for a batchbench document
        that cannot be read, ``OSError``/``ValueError`` for a file that is not JSON at all.
        """
        path = Path(path)
        journal = path.with_suffix(".jsonl")
        if path.suffix == ".jsonl" or (not path.exists() and journal.exists()):
            raw = _fold(journal)
        else:
            raw = json.loads(path.read_text(encoding="utf-8"))
        try:
            return cls.from_dict(raw)
        except NotAResultsDocument as exc:
            raise NotAResultsDocument(f"{path} {exc}") from None
        except DocumentError as exc:
            raise DocumentError(f"{path}: {exc}") from None


assert not {f.name for f in dataclasses.fields(RunHeader)} & {f.name for f in dataclasses.fields(RunFooter)}


# --------------------------------------------------------------------------- the journal


#: Handed to the writer thread last: write what came before, then stop.
_STOP = object()


def _line(entry: dict[str, Any]) -> str:
    return json.dumps(entry, separators=(",", ":")) + "\n"  # encoded in full before anything is written


def _record_line(record: RequestRecord) -> str:
    """A record's journal line. With orjson where installed: json.dumps of a record's chunk times cost the
    client more CPU per chunk than reading the chunk (tests/test_loadgen_benchmark.py). A record holds no
    NaN or infinity (orjson would write null), only clock differences and counts."""
    entry = {"type": "record", **record.to_dict()}
    if orjson is None:
        return _line(entry)
    return orjson.dumps(entry, option=orjson.OPT_APPEND_NEWLINE).decode()


#: The errors of a write that mean the results folder takes no more: full, over quota, read-only, failing.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})


class ResultsWriteError(Exception):
    """A results file could not be written (:data:`WRITE_ERRNOS`, or any other OSError of the write): nothing more
    that is measured can be kept, so the run stops; what was flushed before stays on disk, readable as a partial
    run. Not an OSError, so that no handler of other I/O (a log read, a folder made) takes it for its own."""

    def __init__(self, path: Path, error: OSError) -> None:
        self.path, self.error = path, error
        super().__init__(f"cannot write {path}: {error.strerror or error}")


@dataclass
class JournalWriter:
    """Appends a run's header, records, samples and footer to a journal, then folds it into the document.

    The header and footer are written by the caller; records and samples are handed to a writer
    thread (:meth:`record` and :meth:`sample` only queue them, so the measuring loop never waits for
    the disk). :meth:`close` or :meth:`finish` writes everything handed over before returning; a
    failure to write is raised by the next call after it.
    """

    path: Path
    _journal: IO[str] | None = field(default=None, init=False, repr=False)
    _queue: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)
    _error: BaseException | None = field(default=None, init=False, repr=False)

    @property
    def journal_path(self) -> Path:
        return self.path.with_suffix(".jsonl")

    def begin(self, header: RunHeader) -> None:
        """Open the journal with the header written; :class:`ResultsWriteError` (and no journal) when the folder
        takes nothing."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._journal = open(self.journal_path, "w", encoding="utf-8")  # noqa: SIM115 - open until close()
            self._journal.write(_line({"type": "header", "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
                                       **codec.encode_fields(header)}))
            self._journal.flush()
        except OSError as exc:
            self.abandon()
            self.journal_path.unlink(missing_ok=True)  # a header cut short says nothing a reader could use
            raise ResultsWriteError(self.journal_path, exc) from None
        # A daemon, so that a caller that never closes cannot keep the process alive; closing is the contract.
        self._thread = threading.Thread(target=self._write_batches, name="batchbench-journal", daemon=True)
        self._thread.start()

    def _write_batches(self) -> None:
        """The writer thread: everything queued so far in one write and one flush, until :data:`_STOP`."""
        journal = self._journal
        assert journal is not None
        take, take_now = self._queue.get, self._queue.get_nowait
        while True:
            batch = [take()]
            try:
                while batch[-1] is not _STOP:
                    batch.append(take_now())
            except queue.Empty:
                pass
            stop = batch[-1] is _STOP
            if stop:
                batch.pop()
            if self._error is None:  # after a failure nothing more is written; the caller's next call raises it
                lines: list[str] = []
                try:
                    for kind, item in batch:
                        lines.append(_record_line(item) if kind == "record"
                                     else _line({"type": kind, **codec.encode(item)}))
                except Exception as exc:  # what was encoded before it is still written
                    self._error = exc
                try:
                    journal.write("".join(lines))
                    journal.flush()
                except Exception as exc:
                    self._error = self._error or exc
            if stop:
                return

    def _check(self) -> None:
        if isinstance(self._error, OSError):
            raise ResultsWriteError(self.journal_path, self._error) from None
        if self._error is not None:
            raise self._error

    def record(self, record: RequestRecord) -> None:
        """Queue a finished record for the journal (the record must not change after this)."""
        self._check()
        assert self._thread is not None, "begin() first"
        self._queue.put(("record", record))

    def sample(self, sample: ServerMetrics) -> None:
        """Queue a server-metrics sample for the journal."""
        self._check()
        assert self._thread is not None, "begin() first"
        self._queue.put(("sample", sample))

    def gpu_sample(self, sample: GpuSample) -> None:
        """Queue a GPU telemetry sample for the journal (from the GPU meter's thread: the queue is thread-safe)."""
        self._check()
        assert self._thread is not None, "begin() first"
        self._queue.put(("gpu_sample", sample))

    def _join(self) -> None:
        """Let the writer thread write everything handed over, then stop it."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Write everything handed over and stop, without a footer: what a killed run leaves behind (the journal
        reads as partial). Safe to call twice."""
        self._join()
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        self._check()

    def finish(self, footer: RunFooter) -> RunDocument:
        """Append the footer, write the document (atomically), drop the journal; return the document.

        The document is read back from the journal, so it is exactly what the journal holds.
        """
        self._join()
        if self._error is not None:
            self.close()  # raises it
        assert self._journal is not None, "begin() first"
        try:
            self._journal.write(_line({"type": "footer", **codec.encode_fields(footer)}))
            self.close()
        except OSError as exc:  # the records before the footer stay in the journal: a partial run
            self.abandon()
            raise ResultsWriteError(self.journal_path, exc) from None
        doc = RunDocument.load(self.journal_path)
        tmp = self.path.with_suffix(".json.tmp")
        try:
            tmp.write_text(doc.to_json(), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:  # the journal holds all of it still; no half-written document beside it
            tmp.unlink(missing_ok=True)
            raise ResultsWriteError(self.path, exc) from None
        self.journal_path.unlink()
        return doc

    def abandon(self) -> None:
        """Stop after a write failed, never raising: the writer thread stopped, the journal closed as far as it
        goes (what was flushed before stays readable as a partial run), the failure forgotten."""
        self._join()
        if self._journal is not None:
            with contextlib.suppress(OSError):  # its last buffered bytes could not be written either
                self._journal.close()
            self._journal = None
        self._error = None


def _fold(journal: Path) -> dict[str, Any]:
    """The flat document a journal holds, complete or cut short: a torn last line is dropped, not fatal."""
    doc: dict[str, Any] = {"records": [], "server_metrics": [], "gpu_samples": []}
    parsed_any = ours = header = False
    with open(journal, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            parsed_any = True
            kind = entry.pop("type", None) if isinstance(entry, dict) else None
            if kind not in ENTRY_TYPES:
                continue
            ours = True
            if kind == "header":
                header = True
                doc.update(entry)
            elif kind == "record":
                doc["records"].append(entry)
            elif kind == "sample":
                doc["server_metrics"].append(entry)
            elif kind == "gpu_sample":
                doc["gpu_samples"].append(entry)
            else:
                doc.update(entry)
    if not parsed_any:
        raise DocumentError(f"{journal}: empty journal (the run was killed before its header was written?)")
    if not ours:
        raise NotAResultsDocument(f"{journal} is not a batchbench results document (no batchbench journal entries)")
    if not header:
        raise DocumentError(f"{journal} is not a batchbench results document: journal without a header line")
    doc.setdefault("status", "partial")
    return doc


def load(path: str | os.PathLike[str]) -> RunDocument:
    """Read a results document or a killed run's journal: :meth:`RunDocument.load`."""
    return RunDocument.load(path)


@dataclass
class Found:
    """The results documents under a folder, with what was skipped."""

    #: (path relative to the folder, document), in a stable order.
    documents: list[tuple[str, RunDocument]] = field(default_factory=list)
    #: One line per skipped batchbench file, naming it and why.
    warnings: list[str] = field(default_factory=list)
    #: JSON/JSONL files that are not batchbench results.
    ignored: list[str] = field(default_factory=list)


def _relative(path: Path, root: Path) -> str:
    """A path relative to the results folder: what reads a folder never carries this machine's absolute paths."""
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.name


def discover(results_dir: str | os.PathLike[str], *, exclude: str | os.PathLike[str] | None = None,
             what: str = "") -> Found:
    """Read every results document under ``results_dir`` (recursively), in a stable order.

    A results folder also holds pytest-benchmark output, server logs, earlier reports and, after a
    crash, journals of killed runs. A ``.jsonl`` journal counts only when its ``.json`` sibling is
    absent (the run was killed before finishing); otherwise the finished document supersedes it.
    Foreign files are counted in ``ignored``; a batchbench file that cannot be read is skipped with a
    warning naming it (``what`` prefixes it, e.g. "baseline: "), so one bad file never costs every
    other run. ``exclude`` (e.g. a report's own output folder) is not read.
    """
    root = Path(results_dir)
    found = Found()
    excluded = Path(exclude).resolve() if exclude is not None else None
    paths = sorted(p for p in root.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file())
    for path in paths:
        if excluded is not None and path.resolve().is_relative_to(excluded):
            continue
        if (path.suffix == ".jsonl" and path.with_suffix(".json").exists()) or path.name == CLAIMS_FILE:
            continue
        rel = _relative(path, root)
        try:
            found.documents.append((rel, RunDocument.load(path)))
        except NotAResultsDocument:
            found.ignored.append(rel)
        # DocumentError, JSONDecodeError and UnicodeDecodeError are ValueErrors.
        except (OSError, ValueError) as exc:
            found.warnings.append(f"{what}{rel}: skipped, {unreadable_reason(exc, path, root)}")
    return found


def unreadable_reason(exc: BaseException, path: Path, root: Path) -> str:
    """Why a file was skipped, naming files relative to ``root`` (messages of OSError and
    :meth:`RunDocument.load` name the absolute path)."""
    reason = str(exc).replace(str(path), _relative(path, root)).replace(str(root), root.name)
    return f"not a readable batchbench results document: {reason}"


# --------------------------------------------------------------------------- JSON Schema

def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a results document of this version, from the types above."""
    defs: dict[str, Any] = {}
    header = codec.fields_of(RunHeader)
    footer = codec.fields_of(RunFooter)
    props: dict[str, Any] = {
        "schema": {"const": SCHEMA},
        "schema_version": {"const": SCHEMA_VERSION, "description": "major version; additions keep it"},
    }
    props |= {f.name: codec.field_schema(f, hint, defs) for f, hint in header}
    props["records"] = codec.type_schema(list[RequestRecord], defs) | {
        "description": "every request, in completion order"}
    props["server_metrics"] = codec.type_schema(list[ServerMetrics], defs) | {
        "description": "the scraped time series"}
    props["gpu_samples"] = codec.type_schema(list[GpuSample], defs) | {
        "description": "the GPU telemetry's samples, every sampled GPU at each moment (absent before it was recorded)"}
    props |= {f.name: codec.field_schema(f, hint, defs) for f, hint in footer}
    props["status"] = {"type": "string", "description": RunFooter.__dataclass_fields__["status"].metadata["doc"]}
    footer_keys = [f.name for f, _ in footer]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://batchbench.invalid/{SCHEMA}/v{SCHEMA_VERSION}.schema.json",
        "title": f"{SCHEMA} v{SCHEMA_VERSION}",
        "description": "One batchbench run: header, request records, server metrics, footer (absent when "
                       "partial). Written by batchbench.results.document.JournalWriter, read by RunDocument.load.",
        "type": "object",
        "properties": props,
        "required": ["schema", "schema_version", *(f.name for f, _ in header), "records", "server_metrics",
                     "gpu_samples", "status"],
        "additionalProperties": False,
        # A partial document (a killed run's journal, folded) has no footer; any other has all of it.
        "if": {"properties": {"status": {"const": "partial"}}},
        "then": {"not": {"anyOf": [{"required": [k]} for k in footer_keys if k != "status"]}},
        "else": {"required": footer_keys},
        "$defs": dict(sorted(defs.items())),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["schema"]:
        print("usage: python -m batchbench.results schema > results.schema.json", file=sys.stderr)
        return 2
    print(json.dumps(json_schema(), indent=2))
    return 0

