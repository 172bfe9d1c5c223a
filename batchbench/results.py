"""The results document: one versioned JSON file per run, written as the run goes.

While a run is in progress every record and server-metrics sample is appended
to a journal (``<name>.jsonl``, one JSON object a line, flushed each time), so
a crash, a kill or Ctrl-C loses nothing already measured. When the run ends,
normally or not, the journal is folded into the final ``<name>.json``
document and removed. :func:`load` reads either, so a journal left by a killed
harness is still a usable (``"status": "partial"``) result.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from batchbench.records import RequestRecord
from batchbench.server_metrics import ServerMetrics

SCHEMA = "batchbench.results"
SCHEMA_VERSION = 1


@dataclass
class ResultsWriter:
    """Appends a run's measurements to a journal and finalises the JSON document."""

    path: Path
    _journal: IO[str] | None = field(default=None, init=False, repr=False)

    @property
    def journal_path(self) -> Path:
        return self.path.with_suffix(".jsonl")

    def begin(self, header: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._journal = open(self.journal_path, "w", encoding="utf-8")
        self._write({"type": "header", "schema": SCHEMA, "schema_version": SCHEMA_VERSION, **header})

    def _write(self, doc: dict[str, Any]) -> None:
        assert self._journal is not None, "begin() first"
        self._journal.write(json.dumps(doc, separators=(",", ":")) + "\n")
        self._journal.flush()

    def record(self, record: RequestRecord) -> None:
        self._write({"type": "record", **record.to_dict()})

    def sample(self, sample: ServerMetrics) -> None:
        self._write({"type": "sample", **sample.to_dict()})

    def finish(self, footer: dict[str, Any]) -> dict[str, Any]:
        """Write the final document (atomically) and drop the journal; return the document."""
        self._write({"type": "footer", **footer})
        assert self._journal is not None
        self._journal.close()
        doc = fold(self.journal_path)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1), encoding="utf-8")
        os.replace(tmp, self.path)
        self.journal_path.unlink()
        return doc


def fold(journal: Path) -> dict[str, Any]:
    """Build the results document from a journal, complete or cut short.

    A torn last line (the process died mid-write) is dropped, not fatal.
    """
    doc: dict[str, Any] = {"records": [], "server_metrics": [], "status": "partial"}
    with open(journal, encoding="utf-8") as fh:
        for line in fh:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            kind = entry.pop("type", None)
            if kind == "header":
                doc.update(entry)
            elif kind == "record":
                doc["records"].append(entry)
            elif kind == "sample":
                doc["server_metrics"].append(entry)
            elif kind == "footer":
                doc.update(entry)
    return doc


def load(path: Path) -> dict[str, Any]:
    """Read a results document, or fold the journal a killed run left behind."""
    path = Path(path)
    if path.suffix == ".jsonl" or (not path.exists() and path.with_suffix(".jsonl").exists()):
        doc = fold(path.with_suffix(".jsonl"))
    else:
        doc = json.loads(path.read_text(encoding="utf-8"))
    schema = doc.get("schema") if isinstance(doc, dict) else None
    if schema != SCHEMA:
        raise ValueError(f"{path} is not a batchbench results document (schema {schema!r})")
    if doc.get("schema_version", 0) > SCHEMA_VERSION:
        raise ValueError(f"{path} has schema version {doc['schema_version']}; this batchbench reads {SCHEMA_VERSION}")
    return doc


def records_of(doc: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_dict(r) for r in doc["records"]]
