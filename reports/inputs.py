"""Finding and reading results documents, tolerating everything else that lives in a results folder.

A results folder also holds pytest-benchmark output, server logs, earlier
reports and, after a crash, journals (``.jsonl``) of killed runs. Foreign
files are ignored quietly; a file that claims to be a batchbench result but
cannot be read is skipped with a warning that names it, so one bad file never
costs the report of every other run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchbench.reports.model import MalformedResults, Run, build_run
from batchbench.results import SCHEMA, fold, load


@dataclass
class Inputs:
    """What was found under a results folder."""

    runs: list[Run] = field(default_factory=list)
    #: One line per skipped batchbench file, naming it and why.
    warnings: list[str] = field(default_factory=list)
    #: JSON/JSONL files that are not batchbench results (reported as a count only).
    ignored: list[str] = field(default_factory=list)


def _relative(path: Path, root: Path) -> str:
    """A path relative to the results folder: reports never carry this machine's absolute paths."""
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.name


def _journal_kind(path: Path) -> str:
    """'ours' if any line is a batchbench journal entry, 'empty' if nothing parses, else 'foreign'."""
    parsed_any = False
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            parsed_any = True
            if isinstance(entry, dict) and entry.get("type") in ("header", "record", "sample", "footer"):
                return "ours"
    return "foreign" if parsed_any else "empty"


def _read_json(path: Path) -> dict[str, Any] | None:
    """The document if ``path`` is a batchbench results file, None if it is some other JSON.

    Raises ValueError/OSError for a file that cannot be read or parsed.
    """
    obj = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        return None
    return load(path)  # the harness's reader: schema-version checks live there


def _read_journal(path: Path) -> dict[str, Any] | None:
    kind = _journal_kind(path)
    if kind == "foreign":
        return None
    if kind == "empty":
        raise MalformedResults("empty journal (the run was killed before its header was written?)")
    if fold(path).get("schema") != SCHEMA:
        raise MalformedResults("journal without a batchbench header line")
    return load(path)


def discover(results_dir: Path, *, exclude: Path | None = None, what: str = "") -> Inputs:
    """Read every results document under ``results_dir`` (recursively), in a stable order.

    A ``.jsonl`` journal counts only when its ``.json`` sibling is absent (the
    run was killed before finishing); otherwise the finished document
    supersedes it. ``exclude`` (the report's own output folder) is not read.
    ``what`` prefixes warnings (e.g. "baseline: ").
    """
    found = Inputs()
    excluded = exclude.resolve() if exclude is not None else None
    paths = sorted(p for p in results_dir.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file())
    for path in paths:
        if excluded is not None and path.resolve().is_relative_to(excluded):
            continue
        rel = _relative(path, results_dir)
        try:
            if path.suffix == ".jsonl":
                if path.with_suffix(".json").exists():
                    continue
                doc = _read_journal(path)
            else:
                doc = _read_json(path)
            if doc is None:
                found.ignored.append(rel)
                continue
            found.runs.append(build_run(rel, doc))
        # JSONDecodeError, UnicodeDecodeError and MalformedResults are ValueErrors; TypeError/AttributeError/KeyError
        # come from fields of the wrong type deep inside a hand-edited or corrupted document.
        except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
            # Messages of OSError and batchbench.results.load name the absolute path; reports name files relatively.
            reason = str(exc).replace(str(path), rel).replace(str(results_dir), results_dir.name)
            found.warnings.append(f"{what}{rel}: skipped, not a readable batchbench results document: {reason}")
    return found
