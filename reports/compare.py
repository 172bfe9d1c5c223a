"""Comparisons: engines against each other within a workload, and a build against an earlier one.

Both work on report rows (``ReportedRun.to_row()``, or the rows of an earlier
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

from batchbench.analysis.bound_share import percent
from batchbench.analysis.repeats import Estimate
from batchbench.core import codec
from batchbench.reports.fmt import num
from batchbench.reports.model import KEY_METRICS, METRICS_BY_KEY, canonical, display_name
from batchbench.reports.series import group_series

REPORT_SCHEMA = "batchbench.report"
#: 2: a run's ``server`` figures under the results document's names (kv_usage_peak, waiting_peak, running_peak,
#: kv_danger_samples), all of them, as batchbench.measures.guardrails.Guardrails has them.
REPORT_SCHEMA_VERSION = 2
DEFAULT_THRESHOLD_PCT = 10.0

MatchKey = tuple[str, str, str]


def match_key(row: dict[str, Any]) -> MatchKey:
    """Runs (or series) compare when engine, batching configuration and the exact workload (its hash) agree."""
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
    #: What differs between the two sides' environments (hosts, GPUs, CPU quota, versions), one line each.
    environment: list[str] = field(default_factory=list)
    #: Per matched series whose two sides each have a bound on paper: each side's share of its own limit, one line
    #: each (runs on two GPUs compared by how near each came to what its GPU allows).
    limit_shares: list[str] = field(default_factory=list)

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
                "repeats": m.current.get("repeats"), "baseline_repeats": m.baseline.get("repeats"),
                "engine": m.current["engine"], "batching_label": m.current["batching_label"],
                "workload": m.current["workload"], "labels": m.current.get("labels", {}),
                "status": m.current.get("status"), "baseline_status": m.baseline.get("status"),
                "note": m.note, "deltas": [d.to_dict() for d in m.deltas],
            } for m in self.matches],
            "only_current": [r["run_id"] for r in self.only_current],
            "only_baseline": [r["run_id"] for r in self.only_baseline],
            "environment_differences": self.environment,
            "limit_shares": self.limit_shares,
        }


def _pct(base: float, value: float) -> float | None:
    """Percent change from ``base``; from 0 only "no change" (0%) is defined."""
    if base == 0:
        return 0.0 if value == 0 else None
    return (value - base) / abs(base) * 100.0


def delta(metric: str, baseline: float | None, current: float | None, threshold_pct: float,
          baseline_estimate: Estimate | None = None, current_estimate: Estimate | None = None) -> Delta:
    """Percent change, flagged when it moves beyond ``threshold_pct`` in the metric's worse direction.

    From a baseline of exactly 0 (a rejection rate, say) there is no percent
    change; any move away from 0 in the worse direction is a regression.
    Where both sides were repeated (their :class:`~batchbench.analysis.repeats.Estimate`
    s have intervals), a change is flagged only if it is also beyond noise: the
    interval of current over baseline excludes 1, the rule every "A beats B" of
    batchbench follows. Where only the baseline was repeated, the current value
    must lie outside the baseline's interval. Inside either, it is noise,
    whatever its size.
    """
    if baseline is None or current is None:
        return Delta(metric, baseline, current, None, False, False)
    sign = 1.0 if METRICS_BY_KEY[metric].better == "lower" else -1.0  # positive worse = regression
    pct = _pct(baseline, current)
    if pct is None:
        worse = (current - baseline) * sign
        regression, improvement = worse > 0, worse < 0
    else:
        regression, improvement = pct * sign > threshold_pct, pct * sign < -threshold_pct
    ratio = current_estimate.ratio(baseline_estimate) if current_estimate and baseline_estimate else None
    if ratio is not None and ratio.low is not None:
        beyond = bool(ratio.differs_from_one)
        regression, improvement = regression and beyond, improvement and beyond
    elif baseline_estimate is not None and baseline_estimate.low is not None and baseline_estimate.high is not None:
        outside = not baseline_estimate.low <= current <= baseline_estimate.high
        regression, improvement = regression and outside, improvement and outside
    return Delta(metric, baseline, current, pct, regression, improvement)


def _estimate(spread: dict[str, Any] | None) -> Estimate | None:
    """A series' stored estimate (:meth:`Estimate.to_dict`); None for a single run or a row from an older report
    (a median with its min and max is not an interval to test against)."""
    if not isinstance(spread, dict) or "value" not in spread:
        return None
    try:
        return codec.decode(Estimate, spread)
    except ValueError:
        return None


def compare(current: list[dict[str, Any]], baseline: list[dict[str, Any]], *, source: str,
            threshold_pct: float = DEFAULT_THRESHOLD_PCT) -> BaselineComparison:
    """Match current series to baseline series and diff the means of their key metrics.

    Both sides are first grouped into series (repeats of one measurement,
    :mod:`reports.series`). Series match on engine, batching label, workload
    hash and labels (the repeat number aside). Where the labels differ but
    only one baseline series has that engine, configuration and workload, it
    is used: a run whose labels were renamed still compares.
    """
    result = BaselineComparison(source=source, threshold_pct=threshold_pct,
                                environment=environment_differences(baseline, current))
    base_series = [s.to_row() for s in group_series(baseline)]
    by_key: dict[MatchKey, list[dict[str, Any]]] = defaultdict(list)
    for row in base_series:
        by_key[match_key(row)].append(row)
    used: set[int] = set()
    for row in (s.to_row() for s in group_series(current)):
        candidates = by_key.get(match_key(row), [])
        same_labels = [b for b in candidates if canonical(b["labels"]) == canonical(row["labels"])]
        pool = same_labels or (candidates if len(candidates) == 1 else [])
        if not pool:
            result.only_current.append(row)
            continue
        chosen = pool[0]
        used.add(id(chosen))
        note = (f"mean of {row['repeats']} runs against the mean of {chosen['repeats']} baseline runs"
                if max(row["repeats"], chosen["repeats"]) > 1 else "")
        deltas = [delta(key, num(chosen["metrics"].get(key)), num(row["metrics"].get(key)), threshold_pct,
                        _estimate(chosen["spread"].get(key)), _estimate(row["spread"].get(key)))
                  for key in (spec.key for spec in KEY_METRICS)]
        result.matches.append(Match(row, chosen, deltas, note))
        if (line := limit_share_line(chosen, row)) is not None:
            result.limit_shares.append(line)
    result.only_baseline = [b for b in base_series if id(b) not in used]
    return result


def limit_share_line(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """``vllm [continuous] concurrency=8 layout=continuous regimes: 41% of its limit on paper (bandwidth; 1 x H100
    SXM ...) -> 38% (bandwidth; 1 x A100 ...)`` for two series (or runs) that each have a bound; None otherwise."""
    sa, sb = a.get("of_limit"), b.get("of_limit")
    if sa is None or sb is None:
        return None
    # Named as the comparison's series are (display_name), with the workload, which may be all that tells two apart.
    name = f"{display_name(b.get('engine'), b.get('batching_label'), b.get('labels') or {})} " \
           f"{(b.get('workload') or {}).get('name')}"
    return (f"{name}: {percent(sa['share'])} of its limit on paper ({sa['bound']}; {sa['setup']}) -> "
            f"{percent(sb['share'])} ({sb['bound']}; {sb['setup']})")


def _env_values(rows: list[dict[str, Any]], key: str) -> set[str]:
    """The values one side's runs recorded for an environment field, as text (GPUs by name)."""
    found = set()
    for row in rows:
        env = row.get("environment") or {}
        if key not in env:
            continue
        value = env[key]
        if key == "gpus":
            value = ", ".join(str(g.get("name", g)) if isinstance(g, dict) else str(g) for g in value or []) or "none"
        found.add("none" if value is None else str(value))
    return found


def environment_differences(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[str]:
    """What differs between two sides' environments, a line per field: ``cpu_quota: none -> 1.0 CPU``; package
    versions one by one. Empty where both recorded the same, or neither recorded any (rows of older reports)."""
    lines = []
    for key in ("hostname", "cpu", "cpu_count", "gpus", "engine_gpus", "cpu_quota", "platform", "batchbench_commit"):
        va, vb = _env_values(a, key), _env_values(b, key)
        if va and vb and va != vb:
            lines.append(f"{key}: {'; '.join(sorted(va))} -> {'; '.join(sorted(vb))}")
    pa: dict[str, set[str]] = defaultdict(set)
    pb: dict[str, set[str]] = defaultdict(set)
    for rows, into in ((a, pa), (b, pb)):
        for row in rows:
            for name, version in ((row.get("environment") or {}).get("packages") or {}).items():
                into[name].add(str(version))
    lines.extend(f"{name}: {', '.join(sorted(pa.get(name) or {'absent'}))} -> "
                 f"{', '.join(sorted(pb.get(name) or {'absent'}))}"
                 for name in sorted(pa.keys() | pb.keys()) if pa.get(name) != pb.get(name))
    return lines


def read_report_rows(path: Path) -> list[dict[str, Any]] | None:
    """The rows of an earlier report.json, or None when ``path`` is not one."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("schema") != REPORT_SCHEMA or not isinstance(doc.get("runs"), list):
        return None
    return [r for r in doc["runs"] if isinstance(r, dict) and isinstance(r.get("metrics"), dict) and "run_id" in r]
