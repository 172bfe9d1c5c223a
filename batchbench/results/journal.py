"""Writing a run's results document as the run goes: a journal appended off the measuring loop, folded into the
document when the run ends (:mod:`batchbench.results.document` has the format and reads both)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

try:  # writes a record's line several times faster than json; optional
    import orjson
except ImportError:  # pragma: no cover - exercised where orjson is not installed
    orjson = None  # type: ignore[assignment]

from batchbench.core import codec
from batchbench.core.records import RequestRecord
from batchbench.core.server_metrics import ServerMetrics
from batchbench.measures.gpu import GpuSample
from batchbench.results.document import SCHEMA, SCHEMA_VERSION, RunDocument, RunFooter, RunHeader

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
