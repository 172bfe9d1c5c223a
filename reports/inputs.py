"""Finding and reading results documents, tolerating everything else that lives in a results folder.

The walk itself is :func:`batchbench.results.discovery.discover` (shared with :mod:`batchbench.analysis.findings`):
foreign files are ignored quietly; a file that claims to be a batchbench result but cannot be read
is skipped with a warning that names it, so one bad file never costs the report of every other run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from batchbench.core.greedy import GreedyOutputs
from batchbench.reports.model import ReportedRun, build_run
from batchbench.results.claims import Claim, read_claims
from batchbench.results.discovery import discover as discover_documents
from batchbench.results.discovery import unreadable_reason
from batchbench.results.document import RunDocument
from batchbench.results.greedy import read_greedy


@dataclass
class Inputs:
    """What was found under a results folder."""

    runs: list[ReportedRun] = field(default_factory=list)
    #: The documents the runs were read from, in the same order (what ``batchbench.analysis.findings`` reads).
    documents: list[RunDocument] = field(default_factory=list)
    #: One line per skipped batchbench file, naming it and why.
    warnings: list[str] = field(default_factory=list)
    #: JSON/JSONL files that are not batchbench results (reported as a count only).
    ignored: list[str] = field(default_factory=list)
    #: A pytest session's claims (its ``claims.json``), where the folder is one.
    claims: list[Claim] = field(default_factory=list)
    #: The main job's greedy answers (its ``greedy.json``), for the agreement between engines.
    greedy: list[GreedyOutputs] = field(default_factory=list)


def discover(results_dir: Path, *, exclude: Path | None = None, what: str = "") -> Inputs:
    """Every results document under ``results_dir`` (:func:`batchbench.results.discovery.discover`) as a :class:`Run`.

    ``exclude`` (the report's own output folder) is not read; ``what`` prefixes warnings (e.g. "baseline: ").
    """
    found = discover_documents(results_dir, exclude=exclude, what=what)
    inputs = Inputs(warnings=found.warnings, ignored=found.ignored, claims=read_claims(results_dir),
                    greedy=read_greedy(results_dir))
    for rel, doc in found.documents:
        try:
            inputs.runs.append(build_run(rel, doc))
            inputs.documents.append(doc)
        except ValueError as exc:
            inputs.warnings.append(f"{what}{rel}: skipped, {unreadable_reason(exc, results_dir / rel, results_dir)}")
    return inputs
