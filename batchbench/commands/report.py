"""``batchbench report`` and ``batchbench compare``: reports from results already on disk.

``batchbench report DIR`` builds ``report.{html,md,json}`` from every results
document under ``DIR`` (the same report ``batchbench run`` writes at its end),
optionally against a ``--baseline``: an earlier results folder, results
document or report.json. ``--format md|json|csv`` writes that one file instead:
``report.csv`` has a row per run with the figures of the report's per-run
tables (stored values in their units: seconds, fractions, per-second rates).
``--records-csv`` adds ``records.csv``, every request of every run.

``batchbench compare A B`` puts two result folders side by side: per engine,
layout (and other labels) and metric, B's mean against A's, the change, and
whether it is within noise (``--json``: the same rows as a JSON document). Repeats of one measurement are compared as
means; a change counts only beyond ``--threshold`` percent *and* outside the
95% interval of A's mean over its repeats (inside it, the machine's noise could
have made it), which is the rule a report's baseline comparison uses
(:func:`batchbench.reports.compare.delta`).

Exit status: 0 done; 1 with ``--fail-on-regression`` when a metric regressed
beyond the threshold (so CI can gate on it); 2 nothing to report (no results,
an unreadable baseline) or a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchbench.analysis.accelerators import Accelerator
from batchbench.core.exits import EXIT_FAILURES, EXIT_OK, EXIT_USAGE
from batchbench.core.option_values import parsed_by
from batchbench.core.options import Command, OptionGroup, option
from batchbench.experiment.outcome import answer_lines
from batchbench.measures.slo import Slo
from batchbench.options import gpu_option
from batchbench.reports import fmt
from batchbench.reports.build import FORMATS, RECORDS_CSV, ReportError, build_report, load_rows
from batchbench.reports.compare import DEFAULT_THRESHOLD_PCT, BaselineComparison, Delta, compare
from batchbench.reports.content import format_metric
from batchbench.reports.model import METRICS_BY_KEY, display_name


def _threshold(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, not {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {text}")
    return value


@dataclass(frozen=True)
class GateArgs(OptionGroup):
    """``--threshold`` and ``--fail-on-regression``: on ``report``, ``compare`` and the pytest plugin."""

    threshold: float = option("--threshold", default=DEFAULT_THRESHOLD_PCT, type=_threshold, metavar="PCT",
                              help="percent change that counts as a change (default %(default)g)")
    fail_on_regression: bool = option("--fail-on-regression", default=False, action="store_true",
                                      help="exit 1 when any metric regressed")


@dataclass(frozen=True)
class ReportArgs:
    """``batchbench report``'s options, each declared once."""

    results_dir: Path = option("results_dir", type=Path, metavar="DIR", help="folder searched recursively for results")
    out: Path | None = option("--out", type=Path, metavar="OUT", help="where the report files go (default: DIR/report)")
    baseline: Path | None = option(
        "--baseline", type=Path, metavar="EARLIER",
        help="an earlier results folder, results document or report.json to compare against")
    slo: Slo | None = option(
        "--slo", type=parsed_by(Slo), metavar="OBJECTIVES",
        help="objectives the answer is judged against, e.g. ttft_p99=200ms,tpot_p50=50ms (default: the one the runs "
             "were measured under, where they all were under one)")
    gpu: Accelerator | None = gpu_option()
    no_plots: bool = option("--no-plots", default=False, action="store_true",
                            help="skip the figures (faster; HTML without images)")
    format: str = option(
        "--format", default="html", choices=sorted(FORMATS),
        help="html: report.html with report.md and report.json beside it (the default); md, json, csv: that one "
             "file (report.csv: a row per run, the per-run tables' figures)")
    records_csv: bool = option(
        "--records-csv", default=False, action="store_true",
        help=f"also write {RECORDS_CSV}: every request record of every run, a row each (CSV only: Parquet would need "
             "pyarrow, which batchbench does not depend on)")
    gate: GateArgs = field(default_factory=GateArgs)


@dataclass(frozen=True)
class CompareArgs:
    """``batchbench compare``'s options, each declared once."""

    a: Path = option("a", type=Path, metavar="A", help="the earlier results (folder, document or report.json)")
    b: Path = option("b", type=Path, metavar="B", help="the later results, compared against A")
    json: bool = option(
        "--json", default=False, action="store_true",
        help="print the comparison as JSON (the table's rows, each with its verdict) instead of a table")
    gate: GateArgs = field(default_factory=GateArgs)


def _warn(message: str) -> None:
    print(f"batchbench: warning: {message}", file=sys.stderr)


def main(args: ReportArgs) -> int:
    """``batchbench report``."""
    out = args.out if args.out is not None else args.results_dir / "report"
    try:
        files = FORMATS[args.format] + ((RECORDS_CSV,) if args.records_csv else ())
        result = build_report(args.results_dir, out, baseline=args.baseline, threshold_pct=args.gate.threshold,
                              plots=not args.no_plots, warn=_warn, slo=args.slo, files=files, gpu=args.gpu)
    except ReportError as exc:
        print(f"batchbench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    runs = result.inputs.runs
    partial = sum(r.partial for r in runs)
    print(f"batchbench: {len(runs)} runs ({partial} partial) -> {', '.join(str(f) for f in result.files)}")
    if result.findings is not None:
        for line in answer_lines(result.findings):
            print(f"  {line}")
    if result.baseline is not None:
        print(f"batchbench: {result.regressions} regressions beyond {args.gate.threshold:g}% against {args.baseline}")
        if args.gate.fail_on_regression and result.regressions:
            return EXIT_FAILURES
    return EXIT_OK


def verdict(d: Delta) -> str:
    """What a change means: beyond the threshold and outside A's repeats, or within noise."""
    if d.regression:
        return "REGRESSION"
    if d.improvement:
        return "improved"
    if d.baseline is None or d.current is None:
        return "not comparable"
    return "within noise"


def _interval(row: dict[str, Any], metric: str) -> tuple[float | None, float | None] | None:
    """The 95% interval of a series' mean (an older report's min and max); None for a single run."""
    spread = (row.get("spread") or {}).get(metric) if isinstance(row.get("spread"), dict) else None
    if isinstance(spread, dict) and (spread.get("n") or 0) > 1:
        return fmt.num(spread.get("low", spread.get("min"))), fmt.num(spread.get("high", spread.get("max")))
    return None


def _spread_text(row: dict[str, Any], metric: str, value: float | None) -> str:
    spec = METRICS_BY_KEY[metric]
    text = format_metric(spec, value)
    if (interval := _interval(row, metric)) is not None:
        text += f" [{format_metric(spec, interval[0])}–{format_metric(spec, interval[1])}]"
    return text


def _name(row: dict[str, Any]) -> str:
    return display_name(row.get("engine"), row.get("batching_label"), row.get("labels") or {})


def _shown(d: Delta) -> bool:
    """Whether a metric has a row: one side at least measured it."""
    return d.baseline is not None or d.current is not None


def _improvements(result: BaselineComparison) -> int:
    return sum(d.improvement for m in result.matches for d in m.deltas)


def comparison_lines(result: BaselineComparison) -> list[str]:
    """One heading per matched series (engine, configuration, labels: the layout among them), one line per
    metric: A, B, the change and its verdict; then what only one side has."""
    lines: list[str] = []
    for m in result.matches:
        row = m.current
        wl = row.get("workload") or {}
        lines.append(f"{_name(row)} on {wl.get('name')} (A x{m.baseline.get('repeats', 1)}, "
                     f"B x{row.get('repeats', 1)})")
        width = max(len(spec.title) for spec in METRICS_BY_KEY.values())
        for d in filter(_shown, m.deltas):
            a, b = _spread_text(m.baseline, d.metric, d.baseline), _spread_text(row, d.metric, d.current)
            lines.append(f"  {METRICS_BY_KEY[d.metric].title:<{width}}  {a:>18} -> {b:<18} "
                         f"{fmt.delta_pct(d.pct):>8}  {verdict(d)}")
    for side, rows in (("A", result.only_baseline), ("B", result.only_current)):
        lines += [f"only in {side}: {_name(row)}" for row in rows]
    return lines


def comparison_json(result: BaselineComparison, a: Path, b: Path) -> dict[str, Any]:
    """The comparison's table as JSON: per matched series, a row per metric with A's and B's means (in stored
    units: seconds, per-second rates, fractions), their 95% intervals where repeated, the change and its verdict;
    then what only one side has."""
    return {
        "a": str(a), "b": str(b), "threshold_pct": result.threshold_pct,
        "rule": "a change counts beyond threshold_pct and outside A's 95% interval (paired where both repeated)",
        "regressions": result.regressions, "improvements": _improvements(result),
        "series": [{
            "name": _name(m.current), "engine": m.current.get("engine"), "batching": m.current.get("batching_label"),
            "labels": m.current.get("labels") or {}, "workload": m.current.get("workload"),
            "a_repeats": m.baseline.get("repeats", 1), "b_repeats": m.current.get("repeats", 1),
            "metrics": [{
                "metric": d.metric, "title": METRICS_BY_KEY[d.metric].title,
                "a": d.baseline, "a_interval": _interval(m.baseline, d.metric),
                "b": d.current, "b_interval": _interval(m.current, d.metric),
                "change_pct": d.pct, "verdict": verdict(d),
            } for d in filter(_shown, m.deltas)],
        } for m in result.matches],
        "only_in_a": [_name(row) for row in result.only_baseline],
        "only_in_b": [_name(row) for row in result.only_current],
        "environment_differences": result.environment,
        "limit_shares": result.limit_shares,
    }


def main_compare(args: CompareArgs) -> int:
    """``batchbench compare A B``."""
    try:
        a = load_rows(args.a, None, _warn, what="A")
        b = load_rows(args.b, None, _warn, what="B")
    except ReportError as exc:
        print(f"batchbench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    result = compare(b, a, source=str(args.a), threshold_pct=args.gate.threshold)
    n = result.regressions
    if args.json:
        print(json.dumps(comparison_json(result, args.a, args.b), indent=1))
        return EXIT_FAILURES if args.gate.fail_on_regression and n else EXIT_OK
    print(f"batchbench: B ({args.b}) against A ({args.a}): means over repeats [95% interval], change, verdict "
          f"(a change counts beyond {args.gate.threshold:g}% and outside A's interval)")
    if result.environment:
        print("batchbench: A and B ran in different environments; a change may be the machine's, not the engine's:")
        for line in result.environment:
            print(f"  {line}")
    if result.limit_shares:
        print("batchbench: each against the limit on paper of the GPU it ran on (its share of its own bound):")
        for line in result.limit_shares:
            print(f"  {line}")
    for line in comparison_lines(result):
        print(line)
    print(f"batchbench: {n} regression{'s' if n != 1 else ''}, {_improvements(result)} improvements in "
          f"{len(result.matches)} matched series")
    return EXIT_FAILURES if args.gate.fail_on_regression and n else EXIT_OK


COMMANDS = (
    Command("report", "build report.md, report.html and report.json from results on disk", __doc__, ReportArgs, main),
    Command("compare", "two result folders side by side: the change per metric, and whether it is within noise",
            __doc__, CompareArgs, main_compare),
)
