"""``python -m batchbench.reports build RESULTS_DIR --out OUT_DIR [--baseline EARLIER]``.

Exit status: 0 when the report was written, 2 when there was nothing to
report (or the baseline could not be read), 3 with ``--fail-on-regression``
when a key metric regressed beyond the threshold, so CI can gate on it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from batchbench.reports.build import ReportError, build_report
from batchbench.reports.compare import DEFAULT_THRESHOLD_PCT


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m batchbench.reports", description="Build batchbench reports.")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build report.json, report.md and report.html from results documents")
    b.add_argument("results_dir", type=Path, metavar="RESULTS_DIR", help="folder searched recursively for results")
    b.add_argument("--out", type=Path, default=None, metavar="OUT_DIR",
                   help="where the report files go (default: RESULTS_DIR/report)")
    b.add_argument("--baseline", type=Path, default=None, metavar="EARLIER",
                   help="an earlier results folder, results document or report.json to compare against")
    b.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD_PCT, metavar="PCT",
                   help=f"percent change flagged as a regression (default {DEFAULT_THRESHOLD_PCT:g})")
    b.add_argument("--fail-on-regression", action="store_true", help="exit 3 when any regression is flagged")
    b.add_argument("--no-plots", action="store_true", help="skip the figures (faster; HTML without images)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.threshold < 0:
        print("reports: error: --threshold must be >= 0", file=sys.stderr)
        return 2
    out = args.out if args.out is not None else args.results_dir / "report"
    try:
        result = build_report(args.results_dir, out, baseline=args.baseline, threshold_pct=args.threshold,
                              plots=not args.no_plots)
    except ReportError as exc:
        print(f"reports: error: {exc}", file=sys.stderr)
        return 2
    runs = result.inputs.runs
    partial = sum(r.partial for r in runs)
    print(f"reports: {len(runs)} runs ({partial} partial) -> {', '.join(str(f) for f in result.files)}")
    if result.baseline is not None:
        print(f"reports: {result.regressions} regressions beyond {args.threshold:g}% against {args.baseline}")
        if args.fail_on_regression and result.regressions:
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
