"""Tests for batchbench.results: nothing measured is lost, whatever happens to the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchbench import results
from batchbench.records import RequestRecord
from batchbench.results import SCHEMA, SCHEMA_VERSION, ResultsWriter, fold, load, records_of
from batchbench.server_metrics import ServerMetrics

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

HEADER = {"run_id": "r1", "engine": {"name": "stub"}, "labels": {"k": "v"}}


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
def test_journal_holds_each_record_as_soon_as_record_returns(recs: list[RequestRecord],
                                                             samples: list[ServerMetrics]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "nested" / "run.json"
        writer = ResultsWriter(path)
        writer.begin(HEADER)
        assert writer.journal_path == path.with_suffix(".jsonl")
        for s in samples:
            writer.sample(s)
        for i, rec in enumerate(recs):
            writer.record(rec)
            entries = journal_entries(writer.journal_path)
            assert entries[-1] == {"type": "record", **rec.to_dict()}
            assert len(entries) == 1 + len(samples) + i + 1
        # A crash now (finish never called): the final document does not exist,
        # yet loading it folds the journal into a partial document with everything.
        assert not path.exists()
        for target in (path, writer.journal_path):
            doc = load(target)
            assert doc["status"] == "partial"
            assert doc["schema"] == SCHEMA and doc["schema_version"] == SCHEMA_VERSION
            assert doc["run_id"] == "r1" and doc["labels"] == {"k": "v"}
            assert records_of(doc) == recs
            assert doc["server_metrics"] == [s.to_dict() for s in samples]


@settings(max_examples=80, deadline=None)
@given(st.lists(request_records, min_size=1, max_size=6), st.data())
def test_torn_journal_drops_only_the_incomplete_line(recs: list[RequestRecord], data: st.DataObject) -> None:
    """Cut the journal at any byte after the header: exactly the records written out in full survive."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.json"
        writer = ResultsWriter(path)
        writer.begin(HEADER)
        for rec in recs:
            writer.record(rec)
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
        assert doc["status"] == "partial"
        assert records_of(doc) == recs[:whole]


def test_torn_last_line_example(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    writer = ResultsWriter(path)
    writer.begin(HEADER)
    for i in range(3):
        writer.record(make_record(i))
    with open(writer.journal_path, "a", encoding="utf-8") as fh:
        fh.write('{"type":"record","request_id":"req-3","prompt_len":1')  # died mid-write
    doc = load(path)
    assert [r.request_id for r in records_of(doc)] == ["req-0", "req-1", "req-2"]
    assert records_of(doc) == [make_record(i) for i in range(3)]


# ---------------------------------------------------------------------------
# finishing


@settings(max_examples=40, deadline=None)
@given(st.lists(request_records, max_size=12), st.lists(server_samples, max_size=4))
def test_finish_writes_document_removes_journal_and_round_trips(recs: list[RequestRecord],
                                                                samples: list[ServerMetrics]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.json"
        writer = ResultsWriter(path)
        writer.begin(HEADER)
        # Records and samples interleaved, as a run writes them.
        for i in range(max(len(recs), len(samples))):
            if i < len(recs):
                writer.record(recs[i])
            if i < len(samples):
                writer.sample(samples[i])
        returned = writer.finish({"status": "complete", "duration_s": 1.5})

        assert path.exists()
        assert not writer.journal_path.exists()
        assert sorted(p.name for p in Path(tmp).iterdir()) == ["run.json"]  # no temp file left behind
        on_disk = json.loads(path.read_text(encoding="utf-8"))
        assert on_disk == returned
        doc = load(path)
        assert doc == returned
        assert doc["status"] == "complete" and doc["duration_s"] == 1.5
        assert doc["schema"] == SCHEMA and doc["schema_version"] == SCHEMA_VERSION
        assert "type" not in doc
        assert all("type" not in r for r in doc["records"])
        back = records_of(doc)
        assert back == recs
        assert [RequestRecord.from_dict(r.to_dict()) for r in back] == recs
        assert doc["server_metrics"] == [s.to_dict() for s in samples]


def test_finish_replaces_the_document_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The final file is written elsewhere in full and renamed into place: a reader never sees half of it."""
    path = tmp_path / "run.json"
    path.write_text("previous contents", encoding="utf-8")
    writer = ResultsWriter(path)
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
    writer.finish({"status": "complete"})
    assert len(seen) == 1
    assert not seen[0][0].exists()
    assert load(path)["records"] == [make_record(i).to_dict() for i in range(5)]


def test_failed_finish_keeps_the_journal(tmp_path: Path) -> None:
    """If the footer cannot be written the run is not lost: the journal still loads as partial."""
    path = tmp_path / "run.json"
    writer = ResultsWriter(path)
    writer.begin(HEADER)
    for i in range(3):
        writer.record(make_record(i))
    with pytest.raises(TypeError):
        writer.finish({"status": "complete", "bad": object()})
    assert writer.journal_path.exists() and not path.exists()
    doc = load(path)
    assert doc["status"] == "partial"
    assert records_of(doc) == [make_record(i) for i in range(3)]


def test_fold_without_footer_is_partial_and_with_footer_takes_its_status(tmp_path: Path) -> None:
    journal = tmp_path / "run.jsonl"
    lines = [
        {"type": "header", "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "run_id": "x"},
        {"type": "record", **make_record(0).to_dict()},
        {"type": "sample", **ServerMetrics(t=0.5, running=2.0).to_dict()},
    ]
    journal.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    doc = fold(journal)
    assert doc["status"] == "partial" and len(doc["records"]) == 1 and len(doc["server_metrics"]) == 1
    with open(journal, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"type": "footer", "status": "interrupted", "error": "boom"}) + "\n")
    doc = fold(journal)
    assert doc["status"] == "interrupted" and doc["error"] == "boom"


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
    with pytest.raises(ValueError, match=r"is not a batchbench results document"):
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
import os, signal, sys
from pathlib import Path
from batchbench.results import ResultsWriter
from batchbench.records import RequestRecord

writer = ResultsWriter(Path(sys.argv[1]))
writer.begin({"run_id": "crashed"})
for i in range(5):
    writer.record(RequestRecord(f"req-{i}", prompt_len=10 + i, max_tokens=20, scheduled_s=0.1 * i,
                                sent_s=0.1 * i + 0.01, done_s=1.0 + i, chunk_times=[0.5 + i, 0.75 + i],
                                chunk_tokens=[1, 19], completion_tokens=20, finish_reason="length", ok=True,
                                in_flight_at_send=i + 1))
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
    assert doc["status"] == "partial" and doc["run_id"] == "crashed"
    assert records_of(doc) == [make_record(i) for i in range(5)]
