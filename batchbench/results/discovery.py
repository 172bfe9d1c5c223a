"""Finding results documents under a folder, tolerating everything else that lives there: reports, logs, a
session's claims, killed runs' journals."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from batchbench.results.claims import CLAIMS_FILE
from batchbench.results.document import NotAResultsDocument, RunDocument


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
