"""Comparisons: engines against each other within a workload, and a build against an earlier one.

Both work on report rows (``Run.to_row()``, or the rows of an earlier
report.json), so a baseline can be either a results folder or just the
report.json kept from an earlier build (results folders are often deleted,
reports are kept).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reports.fmt import num
from reports.model import KEY_METRICS, METRICS_BY_KEY, canonical

REPORT_SCHEMA = "batchbench.report"
REPORT_SCHEMA_VERSION = 1
DEFAULT_THRESHOLD_PCT = 10.0

MatchKey = tuple[str, str, str]


def match_key(row: dict[str, Any]) -> MatchKey:
    """Runs compare when engine, batching configuration and the exact workload (its hash) agree."""
    return (str(row.get("engine")), str(row.get("batching_label")), str((row.get("workload") or {}).get("hash")))


# --------------------------------------------------------------------------- within a build


def best_by_metric(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """For each key metric, the best run of ``rows`` and every run's distance from it (percent).

    Meant for rows of one workload: ranking runs of different workloads says nothing.
    """
    out: dict[str, dict[str, Any]] = {}
    for spec in KEY_METRICS:
        values = [(row["run_id"], v) for row in rows if (v := num(row["metrics"].get(spec.key))) is not None]
        if len(values) < 2:
            continue
        pick = min if spec.better == "lower" else max
        best_id, best = pick(values, key=lambda item: item[1])
        out[spec.key] = {
            "better": spec.better,
            "best_run_id": best_id,
            "best": best,
            "tied": sum(1 for _, v in values if v == best),
            "vs_best_pct": {run_id: _pct(best, v) for run_id, v in values},
        }
    return out


# --------------------------------------------------------------------------- against a baseline


@dataclass(frozen=True)
class Delta:
    """One metric of one matched run, baseline against current."""

    metric: str
    baseline: float | None
    current: float | None
    pct: float | None
    regression: bool
    improvement: bool

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "baseline": self.baseline, "current": self.current, "pct": self.pct,
                "regression": self.regression, "improvement": self.improvement}


@dataclass
class Match:
    current: dict[str, Any]
    baseline: dict[str, Any]
    deltas: list[Delta]
    note: str = ""

    @property
    def regressions(self) -> list[Delta]:
        return [d for d in self.deltas if d.regression]


@dataclass
class BaselineComparison:
    source: str
    threshold_pct: float
    matches: list[Match] = field(default_factory=list)
    only_current: list[dict[str, Any]] = field(default_factory=list)
    only_baseline: list[dict[str, Any]] = field(default_factory=list)

    @property
    def regressions(self) -> int:
        return sum(len(m.regressions) for m in self.matches)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "threshold_pct": self.threshold_pct,
            "regressions": self.regressions,
            "matches": [{
                "run_id": m.current["run_id"], "baseline_run_id": m.baseline["run_id"],
                "engine": m.current["engine"], "batching_label": m.current["batching_label"],
                "workload": m.current["workload"], "labels": m.current.get("labels", {}),
                "status": m.current.get("status"), "baseline_status": m.baseline.get("status"),
                "note": m.note, "deltas": [d.to_dict() for d in m.deltas],
            } for m in self.matches],
            "only_current": [r["run_id"] for r in self.only_current],
            "only_baseline": [r["run_id"] for r in self.only_baseline],
        }


def _pct(base: float, value: float) -> float | None:
    """Percent change from ``base``; from 0 only "no change" (0%) is defined."""
    if base == 0:
        return 0.0 if value == 0 else None
    return (value - base) / abs(base) * 100.0


def delta(metric: str, baseline: float | None, current: float | None, threshold_pct: float) -> Delta:
    """Percent change, flagged when it moves beyond ``threshold_pct`` in the metric's worse direction.

    From a baseline of exactly 0 (a rejection rate, say) there is no percent
    change; any move away from 0 in the worse direction is a regression.
    """
    if baseline is None or current is None:
        return Delta(metric, baseline, current, None, False, False)
    sign = 1.0 if METRICS_BY_KEY[metric].better == "lower" else -1.0  # positive worse = regression
    pct = _pct(baseline, current)
    if pct is None:
        worse = (current - baseline) * sign
        return Delta(metric, baseline, current, None, worse > 0, worse < 0)
    return Delta(metric, baseline, current, pct, pct * sign > threshold_pct, pct * sign < -threshold_pct)


def _latest(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return max(rows, key=lambda r: (str(r.get("started_at") or ""), str(r.get("run_id"))))


def compare(current: list[dict[str, Any]], baseline: list[dict[str, Any]], *, source: str,
            threshold_pct: float = DEFAULT_THRESHOLD_PCT) -> BaselineComparison:
    """Match current runs to baseline runs and diff their key metrics.

    Runs match on (engine, batching label, workload hash). When several
    baseline runs share that key (a concurrency sweep labels its points),
    labels must agree too; among equals the most recent baseline run is used.
    """
    result = BaselineComparison(source=source, threshold_pct=threshold_pct)
    by_key: dict[MatchKey, list[dict[str, Any]]] = defaultdict(list)
    for row in baseline:
        by_key[match_key(row)].append(row)
    used: set[int] = set()
    for row in current:
        candidates = by_key.get(match_key(row), [])
        same_labels = [b for b in candidates if canonical(b.get("labels", {})) == canonical(row.get("labels", {}))]
        pool = same_labels or (candidates if len(candidates) == 1 else [])
        if not pool:
            result.only_current.append(row)
            continue
        chosen = _latest(pool)
        used.add(id(chosen))
        note = f"{len(pool)} baseline runs match; compared with the latest" if len(pool) > 1 else ""
        deltas = [delta(spec.key, num(chosen["metrics"].get(spec.key)), num(row["metrics"].get(spec.key)),
                        threshold_pct) for spec in KEY_METRICS]
        result.matches.append(Match(row, chosen, deltas, note))
    result.only_baseline = [b for b in baseline if id(b) not in used]
    return result


def read_report_rows(path: Path) -> list[dict[str, Any]] | None:
    """The rows of an earlier report.json, or None when ``path`` is not one."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("schema") != REPORT_SCHEMA or not isinstance(doc.get("runs"), list):
        return None
    return [r for r in doc["runs"] if isinstance(r, dict) and isinstance(r.get("metrics"), dict) and "run_id" in r]
