"""Tests for batchbench.results.document: nothing measured is lost, whatever happens to the run."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchbench.core import codec
from batchbench.core.config import BatchingConfig, EngineDescription, LoadConfig
from batchbench.core.records import RequestRecord
from batchbench.core.server_metrics import ServerMetrics
from batchbench.measures.client_load import ClientLoad
from batchbench.measures.guardrails import Guardrails, server_summary
from batchbench.measures.machine_load import MachineLoad
from batchbench.measures.metrics import Distribution, Summary, summarize
from batchbench.measures.slo import Slo
from batchbench.results import document as results
from batchbench.results.document import (
    SCHEMA,
    SCHEMA_VERSION,
    DocumentError,
    NotAResultsDocument,
    Placement,
    RunDocument,
    RunFooter,
    RunHeader,
    RunLabels,
    ScrapeStats,
    load,
)
from batchbench.results.journal import JournalWriter
from batchbench.results.schema import json_schema
from batchbench.workload.requests import Arrival, WorkloadSpec, WorkloadSummary

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------
# strategies

floats = st.floats(allow_nan=False, allow_infinity=False)
maybe_float = st.none() | floats
ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
short_text = st.text(max_size=20)
maybe_text = st.none() | short_text

request_records = st.builds(
    RequestRecord,
    request_id=short_text,
    prompt_len=ints,
    max_tokens=ints,
    scheduled_s=floats,
    sent_s=floats,
    done_s=maybe_float,
    chunk_times=st.lists(floats, max_size=8),
    chunk_tokens=st.lists(ints, max_size=8),
    prompt_tokens=st.none() | ints,
    completion_tokens=st.none() | ints,
    finish_reason=maybe_text,
    ok=st.booleans(),
    error_kind=maybe_text,
    error=maybe_text,
    priority=maybe_text,
    wave=st.none() | ints,
    in_flight_at_send=ints,
)
server_samples = st.builds(
    ServerMetrics, t=floats, running=maybe_float, waiting=maybe_float, kv_usage=maybe_float,
    kv_capacity_tokens=maybe_float, preemptions=maybe_float, rejections=maybe_float,
)

HEADER = RunHeader(run_id="r1", engine=EngineDescription(engine="stub", batching=BatchingConfig()),
                   workload=WorkloadSummary(name="w", hash="h"), labels=RunLabels.of({"k": "v"}))


def make_record(i: int) -> RequestRecord:
    return RequestRecord(f"req-{i}", prompt_len=10 + i, max_tokens=20, scheduled_s=0.1 * i, sent_s=0.1 * i + 0.01,
                         done_s=1.0 + i, chunk_times=[0.5 + i, 0.75 + i], chunk_tokens=[1, 19],
                         completion_tokens=20, finish_reason="length", ok=True, in_flight_at_send=i + 1)


def journal_entries(path: Path) -> list[dict[str, Any]]:
    """The journal as another process would see it right now."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


# ---------------------------------------------------------------------------
# the journal survives a crash


@settings(max_examples=40, deadline=None)
@given(st.lists(request_records, max_size=12), st.lists(server_samples, max_size=4))
def test_journal_holds_every_record_handed_over_before_a_crash(recs: list[RequestRecord],
                                                               samples: list[ServerMetrics]) -> None:
    """record() only queues (the writer thread writes); closing, as the runner does however a run ends, writes
    everything handed over before it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "nested" / "run.json"
        writer = JournalWriter(path)
        writer.begin(HEADER)
        assert writer.journal_path == path.with_suffix(".jsonl")
        with pytest.raises(RuntimeError, match="crash"):  # noqa: PT012 - a run that crashes while writing
            try:
                for s in samples:
                    writer.sample(s)
                for rec in recs:
                    writer.record(rec)
                raise RuntimeError("crash")
            finally:
                writer.close()
        entries = journal_entries(writer.journal_path)
        assert entries[1:] == ([{"type": "sample", **codec.encode(s)} for s in samples]
                               + [{"type": "record", **rec.to_dict()} for rec in recs])
        # The crash left no final document, yet loading it folds the journal into a partial document with
        # everything.
        assert not path.exists()
        for target in (path, writer.journal_path):
            doc = load(target)
            assert doc.status == "partial" and doc.footer is None
            assert doc.read_version == SCHEMA_VERSION
            assert doc.to_dict()["schema"] == SCHEMA and doc.to_dict()["schema_version"] == SCHEMA_VERSION
            assert doc.header == HEADER
            assert doc.header.run_id == "r1" and dict(doc.header.labels.items()) == {"k": "v"}
            assert doc.records == recs
            assert doc.server_metrics == samples


@settings(max_examples=80, deadline=None)
@given(st.lists(request_records, min_size=1, max_size=6), st.data())
def test_torn_journal_drops_only_the_incomplete_line(recs: list[RequestRecord], data: st.DataObject) -> None:
    """Cut the journal at any byte after the header: exactly the records written out in full survive."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.json"
        writer = JournalWriter(path)
        writer.begin(HEADER)
        for rec in recs:
            writer.record(rec)
        writer.close()
        raw = writer.journal_path.read_bytes()
        lines = raw.splitlines(keepends=True)
        header_end = len(lines[0])
        cut = data.draw(st.integers(header_end, len(raw)), label="cut")
        writer.journal_path.write_bytes(raw[:cut])

        # A record survives iff its JSON text (newline or not) lies wholly before the cut.
        end, whole = header_end, 0
        for line in lines[1:]:
            if end + len(line.rstrip(b"\n")) <= cut:
                whole += 1
            end += len(line)
        doc = load(path)
        assert doc.status == "partial"
        assert doc.records == recs[:whole]


def test_torn_last_line_example(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    writer = JournalWriter(path)
    writer.begin(HEADER)
    for i in range(3):
        writer.record(make_record(i))
    writer.close()
    with open(writer.journal_path, "a", encoding="utf-8") as fh:
        fh.write('{"type":"record","request_id":"req-3","prompt_len":1')  # died mid-write
    doc = load(path)
    assert [r.request_id for r in doc.records] == ["req-0", "req-1", "req-2"]
    assert doc.records == [make_record(i) for i in range(3)]


# ---------------------------------------------------------------------------
# finishing


@settings(max_examples=40, deadline=None)
@given(st.lists(request_records, max_size=12), st.lists(server_samples, max_size=4))
def test_finish_writes_document_removes_journal_and_round_trips(recs: list[RequestRecord],
                                                                samples: list[ServerMetrics]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.json"
        writer = JournalWriter(path)
        writer.begin(HEADER)
        # Records and samples interleaved, as a run writes them.
        for i in range(max(len(recs), len(samples))):
            if i < len(recs):
                writer.record(recs[i])
            if i < len(samples):
                writer.sample(samples[i])
        footer = RunFooter(status="complete", duration_s=1.5)
        returned = writer.finish(footer)

        assert path.exists()
        assert not writer.journal_path.exists()
        assert sorted(p.name for p in Path(tmp).iterdir()) == ["run.json"]  # no temp file left behind
        on_disk = json.loads(path.read_text(encoding="utf-8"))
        assert on_disk == returned.to_dict()
        doc = load(path)
        assert doc == returned == RunDocument(header=HEADER, records=recs, server_metrics=samples, footer=footer)
        assert doc.status == "complete" and doc.footer is not None and doc.footer.duration_s == 1.5
        assert on_disk["status"] == "complete" and on_disk["duration_s"] == 1.5
        assert on_disk["schema"] == SCHEMA and on_disk["schema_version"] == SCHEMA_VERSION
        assert "type" not in on_disk
        assert all("type" not in r for r in on_disk["records"])
        back = doc.records
        assert back == recs
        assert [codec.decode(RequestRecord, r.to_dict()) for r in back] == recs
        assert on_disk["server_metrics"] == [codec.encode(s) for s in samples]
        assert doc.server_metrics == samples


def test_finish_replaces_the_document_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The final file is written elsewhere in full and renamed into place: a reader never sees half of it."""
    path = tmp_path / "run.json"
    path.write_text("previous contents", encoding="utf-8")
    writer = JournalWriter(path)
    writer.begin(HEADER)
    for i in range(5):
        writer.record(make_record(i))

    real_replace = os.replace
    seen: list[tuple[Path, Path]] = []

    def spy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        src, dst = Path(src), Path(dst)
        seen.append((src, dst))
        assert dst == path and src.parent == path.parent and src != path
        # At the moment of the rename the target is untouched and the source is complete.
        assert path.read_text(encoding="utf-8") == "previous contents"
        complete = json.loads(src.read_text(encoding="utf-8"))
        assert len(complete["records"]) == 5 and complete["status"] == "complete"
        real_replace(src, dst)

    monkeypatch.setattr(results.os, "replace", spy)
    writer.finish(RunFooter(status="complete"))
    assert len(seen) == 1
    assert not seen[0][0].exists()
    assert load(path).records == [make_record(i) for i in range(5)]


def test_failed_finish_keeps_the_journal(tmp_path: Path) -> None:
    """If the footer cannot be written the run is not lost: the journal still loads as partial."""
    path = tmp_path / "run.json"
    writer = JournalWriter(path)
    writer.begin(HEADER)
    for i in range(3):
        writer.record(make_record(i))
    with pytest.raises(TypeError):
        writer.finish(RunFooter(status="complete", engine_report={"bad": object()}))
    assert writer.journal_path.exists() and not path.exists()
    doc = load(path)
    assert doc.status == "partial"
    assert doc.records == [make_record(i) for i in range(3)]


def test_fold_without_footer_is_partial_and_with_footer_takes_its_status(tmp_path: Path) -> None:
    journal = tmp_path / "run.jsonl"
    lines = [
        {"type": "header", "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "run_id": "x",
         "engine": {"engine": "stub", "batching": {}}, "workload": {"name": "w", "hash": "h"}},
        {"type": "record", **make_record(0).to_dict()},
        {"type": "sample", **codec.encode(ServerMetrics(t=0.5, running=2.0))},
    ]
    journal.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    doc = load(journal)
    assert doc.status == "partial" and len(doc.records) == 1 and len(doc.server_metrics) == 1
    with open(journal, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"type": "footer", "status": "interrupted", "error": "boom"}) + "\n")
    doc = load(journal)
    assert doc.status == "interrupted" and doc.footer is not None and doc.footer.error == "boom"


# ---------------------------------------------------------------------------
# load() refuses what it cannot read


@pytest.mark.parametrize(
    "content",
    [
        {"records": []},
        {"schema": "someone.else", "schema_version": 1, "records": []},
        [1, 2, 3],
        "a string",
        None,
        42,
    ],
    ids=["no-schema", "other-schema", "array", "string", "null", "number"],
)
def test_load_rejects_non_batchbench_json(tmp_path: Path, content: Any) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps(content), encoding="utf-8")
    with pytest.raises(NotAResultsDocument, match=r"is not a batchbench results document"):
        load(path)


def test_load_rejects_a_newer_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "future.json"
    path.write_text(json.dumps({"schema": SCHEMA, "schema_version": SCHEMA_VERSION + 1, "records": []}),
                    encoding="utf-8")
    with pytest.raises(ValueError, match=rf"schema version {SCHEMA_VERSION + 1}; this batchbench reads "
                                         rf"{SCHEMA_VERSION}"):
        load(path)


def test_load_rejects_a_journal_from_a_newer_version(tmp_path: Path) -> None:
    journal = tmp_path / "future.jsonl"
    header = {"type": "header", "schema": SCHEMA, "schema_version": SCHEMA_VERSION + 1}
    journal.write_text(json.dumps(header) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"schema version"):
        load(tmp_path / "future.json")


def test_load_rejects_a_journal_without_header(tmp_path: Path) -> None:
    journal = tmp_path / "headless.jsonl"
    journal.write_text(json.dumps({"type": "record", **make_record(0).to_dict()}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"is not a batchbench results document"):
        load(journal)


# ---------------------------------------------------------------------------
# a real crash

CHILD = """
import os, signal, sys, time
from pathlib import Path
from batchbench.core.config import EngineDescription
from batchbench.results.document import RunHeader
from batchbench.results.journal import JournalWriter
from batchbench.workload.requests import WorkloadSummary
from batchbench.core.records import RequestRecord

writer = JournalWriter(Path(sys.argv[1]))
writer.begin(RunHeader(run_id="crashed", engine=EngineDescription(engine="stub"),
                       workload=WorkloadSummary(name="w", hash="h")))
for i in range(5):
    writer.record(RequestRecord(f"req-{i}", prompt_len=10 + i, max_tokens=20, scheduled_s=0.1 * i,
                                sent_s=0.1 * i + 0.01, done_s=1.0 + i, chunk_times=[0.5 + i, 0.75 + i],
                                chunk_tokens=[1, 19], completion_tokens=20, finish_reason="length", ok=True,
                                in_flight_at_send=i + 1))
# No close(): the writer thread writes what it is handed on its own, at once.
deadline = time.monotonic() + 10
while writer.journal_path.read_text().count("\\n") < 6 and time.monotonic() < deadline:
    time.sleep(0.001)
if sys.argv[2] == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
os._exit(1)
"""


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_records_survive_a_killed_process(tmp_path: Path, how: str) -> None:
    path = tmp_path / "run.json"
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    child = subprocess.run([sys.executable, "-c", CHILD, str(path), how], check=False, cwd=REPO,
                           env=env,
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == (-signal.SIGKILL if how == "sigkill" else 1), child.stderr
    assert not path.exists() and path.with_suffix(".jsonl").exists()
    doc = load(path)
    assert doc.status == "partial" and doc.header.run_id == "crashed"
    assert doc.records == [make_record(i) for i in range(5)]


# ---------------------------------------------------------------------------
# the typed document: write -> journal -> fold -> load gives back what was written

json_scalars = st.none() | st.booleans() | ints | floats | short_text
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(short_text, inner, max_size=3), max_leaves=8)
json_objects = st.dictionaries(short_text, json_values, max_size=4)
free_objects = st.dictionaries(short_text.map(lambda k: f"x-{k}"), json_values, max_size=4)
maybe_int = st.none() | ints
distributions = st.none() | st.builds(Distribution, count=ints, mean=floats, min=floats, p50=floats, p90=floats,
                                      p99=floats, max=floats)
summaries = st.builds(
    Summary, duration_s=floats, requests=ints, ok=ints, failed=ints, failures=st.dictionaries(short_text, ints),
    rejected=ints, rejection_rate=maybe_float, ttft=distributions, tpot=distributions, itl=distributions,
    e2e=distributions, e2e_from_schedule=distributions, schedule_lag=distributions, request_throughput=floats,
    output_token_throughput=floats, total_token_throughput=floats, ttft_slo_s=maybe_float, tpot_slo_s=maybe_float,
    good=ints, goodput=floats, goodput_fraction=maybe_float, mean_decoding=maybe_float,
)
guardrails = st.builds(
    Guardrails, samples=ints, kv_usage_peak=maybe_float, kv_danger_threshold=floats, kv_samples=ints,
    kv_danger_samples=ints, kv_danger_entered=st.none() | st.booleans(), kv_danger_first_s=maybe_float,
    kv_danger_time_s=maybe_float, kv_capacity_tokens=maybe_float, waiting_peak=maybe_float,
    running_peak=maybe_float, preemptions=maybe_float, rejections=maybe_float,
)
headers = st.builds(
    RunHeader, run_id=short_text, started_at=maybe_text,
    # Free-form keys beside the typed ones: prefixed, as a free key named like a typed one is not written twice.
    engine=st.builds(EngineDescription, engine=st.text(min_size=1, max_size=10),
                     batching=st.none() | st.builds(BatchingConfig, max_batch_size=st.none() | st.integers(1, 64)),
                     mode=st.none() | st.sampled_from(["url", "LocalLaunch"]), url=maybe_text,
                     server_args=st.none() | st.lists(short_text, max_size=3), details=free_objects),
    workload=st.builds(WorkloadSummary, name=short_text, hash=short_text, num_requests=st.none() | st.integers(1, 99),
                       spec=st.none() | st.builds(WorkloadSpec, name=short_text, num_requests=st.integers(1, 99),
                                                  arrival=st.builds(Arrival, kind=st.just("closed"),
                                                                    concurrency=st.integers(1, 64)))),
    load=st.builds(LoadConfig, request_timeout_s=st.floats(min_value=1e-3, max_value=1e6),
                   max_in_flight=st.integers(1, 2**31),
                   send_until_s=st.none() | st.floats(min_value=1e-3, max_value=1e6),
                   scrape_interval_s=st.none() | st.floats(min_value=1e-3, max_value=1e3), workers=st.integers(1, 64)),
    slo=st.none() | st.builds(lambda limit: Slo.parse(f"ttft_p99={limit}ms,tpot_p50={limit / 10}ms"),
                              st.floats(min_value=1, max_value=1e5)),
    environment=json_objects,
    labels=st.builds(RunLabels, suite=maybe_text, concurrency=st.none() | st.integers(1, 64), others=free_objects),
    placement=st.none() | st.builds(
        Placement, source=st.sampled_from([None, "default", "--cpus"]), applied=st.booleans(),
        engine=st.sampled_from(["local process", "container", "at a URL", "in process", "not known"]),
        engine_cpus=st.none() | st.lists(ints, max_size=4),
        client_cpus=st.lists(st.lists(ints, min_size=1, max_size=3), max_size=3), shared=st.booleans(),
        reason=maybe_text),
)
footers = st.builds(
    RunFooter, status=st.sampled_from(["complete", "interrupted"]), error=maybe_text, finished_at=maybe_text,
    duration_s=maybe_float, engine_report=json_objects,
    scrape=st.builds(ScrapeStats, failures=ints, last_error=maybe_text),
    summary=st.none() | summaries, guardrails=st.none() | guardrails,
    client=st.none() | st.builds(ClientLoad, cpu_s=floats, wall_s=floats, busy_fraction=floats,
                                 loop_wait_s=maybe_float, own_lag_p90_s=maybe_float),
    machine=st.none() | st.builds(MachineLoad, foreign_share=maybe_float, engine_share=maybe_float,
                                  other_share=maybe_float, cpus=maybe_int,
                                  engine_placement=st.none() | st.sampled_from(["server processes", "in process",
                                                                                "not ours"]),
                                  client_cpus=st.none() | st.lists(st.integers(0, 4096), max_size=4)),
)


def write_document(path: Path, doc: RunDocument) -> RunDocument | None:
    """Write ``doc`` as a run would, finishing it only if it has a footer; what finish() returned."""
    writer = JournalWriter(path)
    writer.begin(doc.header)
    for i in range(max(len(doc.records), len(doc.server_metrics))):
        if i < len(doc.records):
            writer.record(doc.records[i])
        if i < len(doc.server_metrics):
            writer.sample(doc.server_metrics[i])
    if doc.footer is None:
        writer.close()
        return None
    return writer.finish(doc.footer)


@settings(max_examples=60, deadline=None)
@given(headers, st.lists(request_records, max_size=5), st.lists(server_samples, max_size=4), st.none() | footers)
def test_a_document_round_trips_through_journal_fold_and_load(header: RunHeader, recs: list[RequestRecord],
                                                              samples: list[ServerMetrics],
                                                              footer: RunFooter | None) -> None:
    original = RunDocument(header=header, records=recs, server_metrics=samples, footer=footer)
    assert RunDocument.from_json(original.to_json()) == original
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.json"
        returned = write_document(path, original)
        if footer is None:
            assert not path.exists()
        else:
            assert returned == original and not path.with_suffix(".jsonl").exists()
        back = load(path)
        assert back == original
        assert back.status == (footer.status if footer is not None else "partial")
        assert back.problems == []
        assert json.loads(back.to_json()) == original.to_dict()


@pytest.mark.parametrize("last", ["record", "footer"])
def test_a_journal_cut_anywhere_in_its_last_line_loads_as_partial(tmp_path: Path, last: str) -> None:
    """Cut at every byte of the last line: the earlier records and samples survive, the run reads as partial."""
    earlier = [make_record(i) for i in range(3)]
    samples = [ServerMetrics(t=0.25 * i, kv_usage=0.1 * i) for i in range(2)]
    footer = RunFooter(status="complete", duration_s=4.5)
    path = tmp_path / "run.json"
    writer = JournalWriter(path)
    writer.begin(HEADER)
    for s in samples:
        writer.sample(s)
    for r in earlier:
        writer.record(r)
    if last == "record":
        writer.record(make_record(3))
    writer.close()
    if last == "footer":  # the footer line exactly as finish() writes it, without the fold that would follow
        footer_keys = {f.name for f in dataclasses.fields(RunFooter)}
        on_disk = RunDocument(header=HEADER, footer=footer).to_dict()
        entry = {"type": "footer", **{k: v for k, v in on_disk.items() if k in footer_keys}}
        with open(writer.journal_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry, separators=(",", ":")) + "\n")
    raw = writer.journal_path.read_bytes()
    last_start = raw.rstrip(b"\n").rindex(b"\n") + 1
    last_json_end = len(raw) - 1  # the last line's JSON text ends before its newline
    for cut in range(last_start, last_json_end):
        writer.journal_path.write_bytes(raw[:cut])
        doc = load(path)
        assert doc.status == "partial" and doc.footer is None, cut
        assert doc.records == earlier and doc.server_metrics == samples, cut
        assert doc.header == HEADER
    for cut in (last_json_end, len(raw)):  # the whole line, with or without its newline
        writer.journal_path.write_bytes(raw[:cut])
        doc = load(path)
        if last == "record":
            assert doc.status == "partial" and doc.records == [*earlier, make_record(3)]
        else:
            assert doc.footer == footer and doc.records == earlier


# ---------------------------------------------------------------------------
# versions


V1_DOCUMENT: dict[str, Any] = {
    # Written by batchbench before version 2: fold()'s key order; no guardrails, client or machine in the
    # footer, no mean_decoding in the summary, no scrape_interval_s in the load settings.
    "records": [make_record(0).to_dict(), make_record(1).to_dict()],
    "server_metrics": [codec.encode(ServerMetrics(t=0.0, kv_usage=0.5, preemptions=3.0)),
                       codec.encode(ServerMetrics(t=0.5, kv_usage=0.9, preemptions=5.0))],
    "status": "complete", "schema": SCHEMA, "schema_version": 1, "run_id": "old",
    "started_at": "2025-01-01T00:00:00+0000", "engine": {"engine": "vllm", "batching": {"mode": "continuous"}},
    "workload": {"name": "chat", "hash": "abc"}, "load": {"request_timeout_s": 60, "max_in_flight": 8},
    "slo": {"ttft_s": None, "tpot_s": None}, "environment": {"python": "3.11"}, "labels": {},
    "error": None, "finished_at": "2025-01-01T00:01:00+0000", "duration_s": 2.0, "engine_report": {},
    "scrape": {"failures": 0, "last_error": None},
    "summary": {k: v for k, v in codec.encode(summarize([make_record(0), make_record(1)], duration_s=2.0)).items()
                if k != "mean_decoding"},
}


def test_a_version_2_slo_reads_as_the_max_objectives_on_its_limits(tmp_path: Path) -> None:
    """Version 2 stored the per-request limits goodput counted against; read as max objectives, they give the
    same limits, and no limit at all is no SLO."""
    doc = {**V1_DOCUMENT, "schema_version": 2, "slo": {"ttft_s": 0.2, "tpot_s": None}}
    (tmp_path / "v2.json").write_text(json.dumps(doc), encoding="utf-8")
    slo = load(tmp_path / "v2.json").header.slo
    assert slo == Slo.parse("ttft_max=200ms") and slo.request_limits() == (0.2, None)
    (tmp_path / "bad.json").write_text(json.dumps({**doc, "slo": {"ttft_p101": 1}}), encoding="utf-8")
    bad = load(tmp_path / "bad.json")
    assert bad.header.slo is None and any(p.startswith("slo unreadable") for p in bad.problems)


def test_a_version_1_document_is_read(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps(V1_DOCUMENT), encoding="utf-8")
    doc = load(path)
    assert doc.read_version == 1 and doc.status == "complete" and doc.header.run_id == "old"
    assert doc.header.load == LoadConfig(request_timeout_s=60.0, max_in_flight=8, scrape_interval_s=None)
    assert doc.header.slo is None
    assert doc.records == [make_record(0), make_record(1)]
    assert doc.footer is not None and doc.footer.summary is not None
    assert doc.footer.summary.mean_decoding is None  # not recorded then; never read as 0
    assert doc.footer.summary.ok == 2
    assert doc.footer.guardrails is None and doc.footer.client is None and doc.footer.machine is None
    assert doc.header.placement is None  # not recorded then
    # Guardrails a v1 document did not store come from its samples, through the runner's own function.
    assert doc.guardrails() == server_summary(doc.server_metrics)
    assert doc.guardrails().kv_danger_entered is True and doc.guardrails().preemptions == 2.0
    # Written again, it is a version 4 document that reads back the same.
    assert doc.to_dict()["schema_version"] == SCHEMA_VERSION == 4
    assert RunDocument.from_dict(doc.to_dict()) == doc


def test_a_version_3_document_reads_its_lora_names_under_their_old_keys(tmp_path: Path) -> None:
    """Version 3 called a request's LoRA its ``adapter``, the summary's per-LoRA figures ``adapters`` and
    ``adapter_fairness`` and a sample's ``lora_adapters_active``; read, they are the same values under today's
    names."""
    recs = [dataclasses.replace(make_record(i), lora=name) for i, name in enumerate(["a", "b", "a"])]
    summary = summarize(recs, duration_s=2.0)
    assert summary.loras is not None and summary.lora_fairness is not None
    old = {k: v for k, v in codec.encode(summary).items() if k not in ("loras", "lora_fairness")}
    old.update(adapters=codec.encode(summary)["loras"], adapter_fairness=summary.lora_fairness)
    old_records = []
    for r in recs:
        d = r.to_dict()
        d["adapter"] = d.pop("lora")
        old_records.append(d)
    samples = [{**codec.encode(ServerMetrics(t=0.0)), "lora_adapters_active": ["a", "b"]}]
    samples[0].pop("loras_active")
    path = tmp_path / "v3.json"
    path.write_text(json.dumps({**V1_DOCUMENT, "schema_version": 3, "records": old_records, "summary": old,
                                "server_metrics": samples}), encoding="utf-8")
    doc = load(path)
    assert doc.server_metrics[0].loras_active == ["a", "b"]
    assert [r.lora for r in doc.records] == ["a", "b", "a"] and doc.problems == []
    assert doc.footer is not None and doc.footer.summary is not None
    assert doc.footer.summary.loras == summary.loras and doc.footer.summary.lora_fairness == summary.lora_fairness
    assert "adapter" not in doc.to_dict()["records"][0] and "loras" in doc.to_dict()["summary"]


def test_unknown_keys_of_a_newer_minor_change_are_ignored(tmp_path: Path) -> None:
    writer = JournalWriter(tmp_path / "run.json")
    writer.begin(HEADER)
    writer.record(make_record(0))
    expected = writer.finish(RunFooter(status="complete", summary=summarize([make_record(0)], duration_s=2.0)))
    raw = json.loads(writer.path.read_text(encoding="utf-8"))
    raw["new_top_level"] = {"x": 1}
    raw["load"]["new_setting"] = 3
    raw["records"][0]["new_timing"] = 0.5
    raw["summary"]["new_metric"] = 1.0
    raw["summary"]["ttft"]["p999"] = 1.0
    writer.path.write_text(json.dumps(raw), encoding="utf-8")
    assert load(writer.path) == expected


def test_the_stored_guardrails_are_read_not_recomputed(tmp_path: Path) -> None:
    samples = [ServerMetrics(t=0.0, kv_usage=0.1), ServerMetrics(t=1.0, kv_usage=0.2)]
    stored = dataclasses.replace(server_summary(samples), kv_usage_peak=0.99, kv_danger_samples=7)
    doc = RunDocument(header=HEADER, server_metrics=samples, footer=RunFooter(status="complete", guardrails=stored))
    write_document(tmp_path / "run.json", doc)
    back = load(tmp_path / "run.json")
    assert back.guardrails() == stored != server_summary(samples)
    partial = RunDocument(header=HEADER, server_metrics=samples)
    assert partial.guardrails() == server_summary(samples)


@pytest.mark.parametrize(("section", "message"), [
    ("client", "client load unreadable ('client.cpu_s' is 'x', not a number)"),
    ("machine", "machine load unreadable ('machine.foreign_share' is 'lots', not a number)"),
])
def test_an_unreadable_load_section_is_a_problem_not_a_crash(section: str, message: str) -> None:
    raw = RunDocument(header=HEADER, footer=RunFooter(status="complete")).to_dict()
    raw[section] = {"cpu_s": "x", "wall_s": 1, "busy_fraction": 0} if section == "client" else {"foreign_share": "lots"}
    doc = RunDocument.from_dict(raw)
    assert doc.problems == [message]
    assert doc.footer is not None and getattr(doc.footer, section) is None


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.pop("engine"), r"'engine' is missing"),
    (lambda d: d["engine"].pop("engine"), r"'engine.engine' is missing"),
    (lambda d: d["workload"].pop("name"), r"'workload.name' is missing"),
    (lambda d: d["records"][0].update(sent_s="soon"), r"'records\[0\].sent_s' is 'soon', not a number"),
    (lambda d: d["summary"].update(ok=1.5), r"'summary.ok' is 1.5, not an integer"),
    (lambda d: d.update(schema_version="2"), r"'schema_version' is '2', not a version number"),
])
def test_a_malformed_document_is_refused_naming_the_key(tmp_path: Path, change: Any, message: str) -> None:
    doc = RunDocument(header=HEADER, records=[make_record(0)],
                      footer=RunFooter(status="complete", summary=summarize([make_record(0)], duration_s=2.0)))
    raw = doc.to_dict()
    change(raw)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw), encoding="utf-8")
    with pytest.raises(DocumentError, match=message) as info:
        load(path)
    assert not isinstance(info.value, NotAResultsDocument)
    assert str(path) in str(info.value)


# ---------------------------------------------------------------------------
# the JSON Schema users get


def test_the_committed_schema_is_the_generated_one() -> None:
    committed = json.loads((REPO / "results.schema.json").read_text(encoding="utf-8"))
    assert committed == json_schema(), "regenerate: python -m batchbench.results schema > results.schema.json"
    jsonschema.Draft202012Validator.check_schema(committed)


@dataclasses.dataclass(frozen=True)
class _Judged:
    value: float

    @property
    def high(self) -> bool:
        return self.value > 1.0

    JSON_DERIVED: ClassVar[tuple[str, ...]] = ("high",)


def test_a_derived_key_is_written_typed_by_its_property_and_ignored_when_read() -> None:
    assert codec.encode(_Judged(2.0)) == {"value": 2.0, "high": True}
    assert codec.decode(_Judged, {"value": 0.5, "high": True}) == _Judged(0.5)
    schema = codec.object_schema(_Judged, {})
    assert schema["properties"]["high"]["readOnly"] is True and "boolean" in json.dumps(schema["properties"]["high"])
    assert schema["required"] == ["value", "high"]


def test_a_derived_key_that_is_not_a_property_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Wrong:
        value: float
        JSON_DERIVED: ClassVar[tuple[str, ...]] = ("value",)

    with pytest.raises(TypeError, match="'value', which is not a property"):
        codec.encode(Wrong(1.0))


def test_the_schema_command_prints_it() -> None:
    out = subprocess.run([sys.executable, "-m", "batchbench.results", "schema"], check=True, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout) == json_schema()


async def test_a_document_written_by_the_runner_validates_against_the_schema(tmp_path: Path) -> None:
    from batchbench.adapters.vllm import VLLMEngine
    from batchbench.core.config import ModelRef
    from batchbench.fixtures.protocol.vllm import VLLMServer
    from batchbench.load.runner import run
    from batchbench.workload.requests import Arrival, Lengths, WorkloadSpec

    server = VLLMServer(model="fake-model", token_delay=0.001)
    await server.start_async()
    try:
        wl = WorkloadSpec("schema", 6, prompt=Lengths.fixed(4), output=Lengths.fixed(8),
                          arrival=Arrival("closed", concurrency=3)).build()
        async with VLLMEngine(model=ModelRef("fake-model"), url=server.url) as engine:
            result = await run(engine, wl, results_dir=tmp_path, slo=Slo.parse("ttft_max=1s"),
                               labels={"suite": "schema"})
    finally:
        await server.stop_async()
    validator = jsonschema.Draft202012Validator(json_schema())
    raw = json.loads(result.path.read_text(encoding="utf-8"))
    assert sorted(e.message for e in validator.iter_errors(raw)) == []
    doc = load(result.path)
    assert doc.status == "complete" and len(doc.records) == 6 and doc.records == result.records
    # No placement was asked on this thread: said so, with where the load generator and the engine ran.
    assert doc.header.placement == Placement(source=None, applied=False, engine="at a URL", engine_cpus=None,
                                             client_cpus=[sorted(os.sched_getaffinity(0))], shared=False,
                                             reason="no CPU placement was asked for")
    assert doc.footer is not None and doc.footer.summary == result.summary
    assert doc.footer.client == result.client and doc.footer.machine == result.machine
    assert doc.guardrails() == server_summary(result.samples)
    # A partial document (a killed run's journal, folded) validates too, and a footer half-present does not.
    partial = RunDocument(header=doc.header, records=doc.records, server_metrics=doc.server_metrics).to_dict()
    assert list(validator.iter_errors(partial)) == []
    assert list(validator.iter_errors(partial | {"summary": raw["summary"]}))
    assert list(validator.iter_errors({k: v for k, v in raw.items() if k != "guardrails"}))
    assert list(validator.iter_errors(raw | {"client": raw["client"] | {"extra": 1}}))
