"""Build report.json, report.md and report.html from a folder of results documents.

Used by ``batchbench report`` and by ``batchbench run`` once its runs are
written. Problems with individual files are warnings (the report is still
built from the rest); having nothing to report at all is an error, raised as
:class:`ReportError` so callers print one clear message, not a traceback. The
report leads with the findings (``batchbench.analysis.findings``) when they can be drawn.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchbench.analysis.accelerators import Accelerator
from batchbench.analysis.agreement import agreements
from batchbench.analysis.findings import Findings, findings_from_documents
from batchbench.measures.guardrails import KV_DANGER
from batchbench.measures.slo import Slo
from batchbench.reports import exports, markdown, render_html
from batchbench.reports.blocks import Document
from batchbench.reports.compare import (
    DEFAULT_THRESHOLD_PCT,
    REPORT_SCHEMA,
    REPORT_SCHEMA_VERSION,
    BaselineComparison,
    best_by_metric,
    compare,
    read_report_rows,
)
from batchbench.reports.content import build_document, group_by_workload
from batchbench.reports.inputs import Inputs, discover
from batchbench.reports.model import KEY_METRICS
from batchbench.reports.series import group_series


class ReportError(Exception):
    """Nothing can be reported (no results, unreadable baseline): a message for the user."""


@dataclass
class BuildResult:
    out_dir: Path
    inputs: Inputs
    baseline: BaselineComparison | None
    files: list[Path] = field(default_factory=list)
    #: What the report leads with; None when it was built without findings.
    findings: Findings | None = None

    @property
    def regressions(self) -> int:
        return self.baseline.regressions if self.baseline is not None else 0


def _print_warning(message: str) -> None:
    print(f"reports: warning: {message}", file=sys.stderr)


def load_rows(path: Path, exclude: Path | None, warn: Callable[[str], None],
              what: str = "baseline") -> list[dict[str, Any]]:
    """Report rows from an earlier report.json, a results folder, or a single results document.

    ``what`` names the input in messages ("baseline", or "A" and "B" of ``batchbench compare``)."""
    if not path.exists():
        raise ReportError(f"{what} {path} does not exist")
    if path.is_file():
        rows = read_report_rows(path)
        if rows is not None:
            return rows
        found = discover(path.parent, what=f"{what}: ")
        runs = [r for r in found.runs if r.source == path.name]
        if not runs:
            raise ReportError(f"{what} {path} is neither a report.json nor a batchbench results document")
        return [r.to_row() for r in runs]
    found = discover(path, exclude=exclude, what=f"{what}: ")
    for message in found.warnings:
        warn(message)
    if not found.runs:
        raise ReportError(f"no batchbench results documents under {what} folder {path}")
    return [r.to_row() for r in found.runs]


def compute_findings(inputs: Inputs, slo: Slo | None = None, gpu: Accelerator | None = None) -> Findings:
    """:mod:`batchbench.analysis.findings` over the documents (their limit on paper for ``gpu`` where given): the
    answer the report leads with."""
    return findings_from_documents(inputs.documents, slo=slo, gpu=gpu)


def report_json(inputs: Inputs, baseline: BaselineComparison | None, generated_at: str,
                findings: Findings | None = None) -> dict[str, Any]:
    """The machine-readable report: the findings, a row per run, and comparisons (a later build's baseline
    reads it)."""
    groups = group_by_workload(inputs.runs)
    return {
        "schema": REPORT_SCHEMA,
        "schema_version": REPORT_SCHEMA_VERSION,
        "generated_at": generated_at,
        "findings": None if findings is None else findings.to_dict(),
        "kv_danger_threshold": KV_DANGER,
        "metrics": {m.key: {"title": m.title, "better": m.better, "summary_path": list(m.path)} for m in KEY_METRICS},
        "runs": [r.to_row() for _, members in groups for r in members],
        # Repeats of one measurement (reports/series.py): the means comparisons use, with their intervals.
        "series": [s.to_row() for _, members in groups for s in group_series([r.to_row() for r in members])],
        "comparisons": {
            "by_workload": [{
                "workload": {"name": name, "hash": digest},
                "run_ids": [r.run_id for r in members],
                "best": best_by_metric([r.to_row() for r in members]),
            } for (name, digest), members in groups],
            "baseline": baseline.to_dict() if baseline is not None else None,
        },
        "warnings": inputs.warnings,
        "ignored_files": inputs.ignored,
        # A pytest session's claims (claims.json), with their intervals in the text; absent for other folders.
        "claims": [dataclasses.asdict(c) for c in inputs.claims],
        # The main job's greedy answers compared, engine pair by pair (greedy.json); absent for other folders.
        "greedy_agreement": [{
            "engines": [p.a.engine, p.b.engine], "weights": [p.a.weights, p.b.weights],
            "tokens_agree": p.same_tokens, "tokens": p.tokens, "outputs_identical": p.same_outputs,
            "outputs": p.outputs, "first_difference_median": p.first_difference,
        } for p in agreements(inputs.greedy)[0]],
    }


#: ``build_report(findings=...)``'s default: draw them from the documents (:func:`compute_findings`).
FROM_DOCUMENTS: Any = object()

#: The files each ``batchbench report --format`` writes: html is the whole report, its Markdown and JSON beside
#: it (what ``batchbench run`` writes); every other format is its one file.
FORMATS: dict[str, tuple[str, ...]] = {
    "html": ("report.html", "report.md", "report.json"), "md": ("report.md",), "json": ("report.json",),
    "csv": ("report.csv",),
}
#: The per-request records of every run (``batchbench report --records-csv``).
RECORDS_CSV = "records.csv"


def build_report(results_dir: Path, out_dir: Path, *, baseline: Path | None = None,
                 threshold_pct: float = DEFAULT_THRESHOLD_PCT, plots: bool = True,
                 warn: Callable[[str], None] = _print_warning, slo: Slo | None = None,
                 findings: Findings | None = FROM_DOCUMENTS, files: tuple[str, ...] = FORMATS["html"],
                 gpu: Accelerator | None = None) -> BuildResult:
    """Read every results document under ``results_dir`` and write the report's ``files`` to ``out_dir`` (by
    default the three of :data:`FORMATS` ``["html"]``; also ``report.csv`` and :data:`RECORDS_CSV`).

    ``findings`` are drawn from the documents (under ``slo``, a :class:`batchbench.measures.slo.Slo`, and with the
    limit on paper for ``gpu`` where given instead of each run's own GPU) unless given (None: a report without its
    answer section); only the files that show them (html, md, json) need them.
    """
    results_dir, out_dir = Path(results_dir), Path(out_dir)
    if not results_dir.is_dir():
        raise ReportError(f"results folder {results_dir} does not exist or is not a folder")
    inputs = discover(results_dir, exclude=out_dir)
    for message in inputs.warnings:
        warn(message)
    if not inputs.runs:
        skipped = f" ({len(inputs.warnings)} unreadable, {len(inputs.ignored)} other JSON files)" \
            if inputs.warnings or inputs.ignored else ""
        raise ReportError(f"no batchbench results documents found under {results_dir}{skipped}; nothing to report")
    comparison = None
    if baseline is not None:
        rows = load_rows(Path(baseline), out_dir, warn)
        ordered = [r.to_row() for _, members in group_by_workload(inputs.runs) for r in members]
        comparison = compare(ordered, rows, source=Path(baseline).name,
                             threshold_pct=threshold_pct)
    if findings is FROM_DOCUMENTS:
        shown = {"report.html", "report.md", "report.json"} & set(files)
        findings = compute_findings(inputs, slo, gpu) if shown else None
    generated_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")

    @functools.cache
    def doc() -> Document:
        return build_document(inputs, generated_at=generated_at, baseline=comparison, with_plots=plots,
                              findings=findings)

    render: dict[str, Callable[[], str]] = {
        "report.json": lambda: json.dumps(report_json(inputs, comparison, generated_at, findings), indent=1) + "\n",
        "report.md": lambda: markdown.render(doc()),
        "report.html": lambda: render_html.render(doc()),
        "report.csv": lambda: exports.runs_csv(inputs),
        RECORDS_CSV: lambda: exports.records_csv(inputs),
    }
    contents = {name: render[name]() for name in files}
    return BuildResult(out_dir, inputs, comparison, _write_all(out_dir, contents), findings)


def _write_all(out_dir: Path, contents: dict[str, str]) -> list[Path]:
    """Write every file in full beside its final name first, then rename them all into place.

    A full disk mid-write leaves the previous report whole (never a truncated report.html beside a new
    report.json) and removes the temporary files.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    staged: list[tuple[Path, Path]] = []
    try:
        for name, text in contents.items():
            tmp = out_dir / f".{name}.tmp"
            tmp.write_text(text, encoding="utf-8")
            staged.append((tmp, out_dir / name))
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        (out_dir / f".{name}.tmp").unlink(missing_ok=True)
        raise
    for tmp, final in staged:
        os.replace(tmp, final)
    return [final for _, final in staged]


def build(results_dir: Path, out_dir: Path, baseline: Path | None = None,
          threshold_pct: float = DEFAULT_THRESHOLD_PCT) -> Path:
    """:func:`build_report`, returning the folder written (what ``batchbench run`` prints)."""
    return build_report(results_dir, out_dir, baseline=baseline, threshold_pct=threshold_pct).out_dir
