"""Finding and reading results documents, tolerating everything else that lives in a results folder.

A results folder also holds pytest-benchmark output, server logs, earlier
reports and, after a crash, journals (``.jsonl``) of killed runs. Foreign
files are ignored quietly; a file that claims to be a batchbench result but
cannot be read is skipped with a warning that names it, so one bad file never
costs the report of every other run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from batchbench.reports.model import Run, build_run
from batchbench.results import NotAResultsDocument, RunDocument


@dataclass
class Inputs:
    """What was found under a results folder."""

    runs: list[Run] = field(default_factory=list)
    #: The documents the runs were read from, in the same order (what ``batchbench.findings`` reads).
    documents: list[RunDocument] = field(default_factory=list)
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
            if path.suffix == ".jsonl" and path.with_suffix(".json").exists():
                continue
            doc = RunDocument.load(path)
            found.runs.append(build_run(rel, doc))
            found.documents.append(doc)
        except NotAResultsDocument:
            found.ignored.append(rel)
        # DocumentError, JSONDecodeError and UnicodeDecodeError are ValueErrors.
        except (OSError, ValueError) as exc:
            # Messages of OSError and RunDocument.load name the absolute path; reports name files relatively.
            reason = str(exc).replace(str(path), rel).replace(str(results_dir), results_dir.name)
            found.warnings.append(f"{what}{rel}: skipped, not a readable batchbench results document: {reason}")
    return found
