"""What a measured run or a finished experiment says: why an engine died, failed requests, the run's
verdict lines, the answer and the report at the end."""

from __future__ import annotations

import sys
from pathlib import Path

from batchbench.analysis import validity
from batchbench.analysis.accelerators import Accelerator
from batchbench.analysis.findings import QUESTIONS, Findings
from batchbench.analysis.findings.decisions import slo_text
from batchbench.core.exits import EXIT_FAILURES
from batchbench.load.runner import MeasuredRun
from batchbench.measures.slo import Slo


def died(result: MeasuredRun) -> str | None:
    """Why the engine is gone, if this run says so: a record that saw it die, or nothing reachable at all."""
    for record in result.records:
        if record.error_kind == "engine_died":
            return record.error
    if result.records and all(r.error_kind in ("unreachable", "engine_died") for r in result.records):
        return result.records[0].error
    return None


def failure_lines(result: MeasuredRun, timeout_s: float) -> list[str]:
    """Failed requests by kind with the first message; a timed-out request's wait is in the run's duration."""
    kinds = result.summary.failures  # the summary already counts them by kind
    if not kinds:
        return []
    first = next(r.error for r in result.records if not r.ok)
    by_count = sorted(kinds.items(), key=lambda kind_n: -kind_n[1])
    lines = [f"failed: {', '.join(f'{n} {kind}' for kind, n in by_count)}; first: {first}"]
    if kinds.get("timeout"):
        lines.append(f"{kinds['timeout']} request(s) hit the {timeout_s:g}s request timeout: this run's duration, "
                     "and so its throughput, include that wait (--request-timeout)")
    return lines


def verdict_lines(result: MeasuredRun) -> list[str]:
    """The run's verdict as it ends, from its client and machine loads through :mod:`batchbench.analysis.validity`:
    ``INVALID (kind): sentence`` per rule they broke, then ``warning: ...`` per caveat that does not invalidate
    it (chunks the server delivered together). Failed requests have lines of their own (:func:`failure_lines`)."""
    return ([reason.line() for reason in validity.load_reasons(result.client, result.machine)]
            + [f"warning: {note}" for note in [*result.client.notes(), *connection_notes(result)]])


def connection_notes(result: MeasuredRun) -> list[str]:
    """Requests sent again because a kept-alive connection had been closed before they were answered (the server
    never saw them: not failures), and why the client stopped reusing connections."""
    resent = sum(1 for r in result.records if r.resent)
    if not resent:
        return []
    why = result.engine_report.get("connections")
    return [f"{resent} request(s) sent again on a fresh connection after the kept-alive one closed unanswered"
            + (f"; {why}" if isinstance(why, str) else "")]


def answer_lines(findings: Findings) -> list[str]:
    """The answer as the report's first screen gives it: the pick across engines, then per engine each question's
    one line, then what was left out."""
    lead = findings.pick.sentences() if findings.pick is not None else []
    lines = list(lead)
    for d in findings.decisions:
        lines.append(f"{d.engine}:")
        answers = d.answers(findings.slo)
        lines += [f"  {QUESTIONS[key]}: {answers[key]}" for key in QUESTIONS]
    lines += [f"- {sentence}" for sentence in findings.answer[len(lead):]]
    return lines


def write_report(run_dir: Path, status: int, slo: Slo | None, *, details: bool = False,
                 gpu: Accelerator | None = None) -> int:
    """Build the run folder's report under ``slo`` (its limit on paper for ``gpu`` where given, else each run's own
    GPU), print the answer (``details``: every topic's sentence too) and where the report went; the exit status,
    raised to 1 if no report could be built."""
    from batchbench.reports.build import ReportError, build_report  # the report is the last step, and heavy

    try:
        report = build_report(run_dir, run_dir / "report", slo=slo, gpu=gpu)
    except ReportError as exc:
        print(f"batchbench: results written, but no report: {exc}", file=sys.stderr)
        return max(status, EXIT_FAILURES)
    if report.findings is not None:
        print(f"batchbench: the answer (SLO: {slo_text(slo)}):")
        for line in answer_lines(report.findings):
            print(f"  {line}")
        for sentence in report.findings.details if details else ():
            print(f"  - {sentence}")
    print(f"batchbench: report written to {report.out_dir}")
    return status
