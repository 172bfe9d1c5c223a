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
normally or not, :class:`~batchbench.results.journal.JournalWriter` folds the journal into the final
``<name>.json`` document (atomically) and removes it. :meth:`RunDocument.load`
reads either, so a journal left by a killed harness is still a usable result
(status ``"partial"``, no footer).

This module is the format: the types, and reading a document or a journal. Writing one as the run goes is
:mod:`batchbench.results.journal`, finding them under a folder :mod:`batchbench.results.discovery`, and the JSON
Schema :mod:`batchbench.results.schema`.

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

import dataclasses
import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

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
    fit: int | None = field(default=None, metadata=_label(
        "the batch size the main job's sweep was designed around (its static waves and padding pair run there)"))
    generations: int | None = field(default=None, metadata=_label(
        "rounds of the main job's clients each run holds (sized to the engine's share of the time limit)"))
    rate: float | str | None = field(default=None, metadata=_label(
        "the request rate of an open-loop level, requests/s ('inf': every request at once)"))
    slo: str | None = field(default=None, metadata=_label("the SLO a bench or capacity level was judged against"))
    others: dict[str, Any] = field(default_factory=dict, metadata={"rest": True})

    @classmethod
    def of(cls, labels: dict[str, Any] | None) -> RunLabels:
        """Labels given as a mapping (a suite's), typed."""
        return codec.decode(cls, codec.encode(labels or {}), "labels")

    @functools.cached_property
    def _given(self) -> dict[str, Any]:
        """The labels given, encoded once: a report names and groups every run by them, many times over."""
        return {k: v for k, v in codec.encode(self).items() if v is not None}

    def items(self) -> list[tuple[str, Any]]:
        """Every label the run was given (null ones left out), typed ones first, then a suite's own: what a report
        names a run by and lists as its columns."""
        return list(self._given.items())

    def value(self, name: str) -> Any:
        """A label by its name, typed or a suite's own (None: not given)."""
        return self._given.get(name)


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
    ip: str | None = field(default=None, metadata=field_doc(
        "its node's IP address as Ray reports it, the address the engine saw its requests come from; null: a local "
        "process"))
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
