"""Repeats of one measurement, reduced to an estimate: the mean with its 95% interval.

A run on a shared machine is one sample of that machine's noise: on two
vCPUs the same run's throughput moves by tens of percent from one minute to
the next. So the main job (and any suite that repeats) measures each
configuration several times, labelling each run with its ``repeat``; runs
that agree on everything else (engine, batching configuration, workload
hash, other labels) form a *series*. Comparisons use the series' mean and
the report shows its interval, so a reader sees how far to trust a
difference. The statistic is the repeat protocol's
(:class:`batchbench.analysis.repeats.Estimate`, the same as the findings'); every run
of a series counts here, disturbed or not: the report flags a disturbed run
beside it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from batchbench.analysis.repeats import Estimate
from batchbench.core import codec
from batchbench.reports.fmt import num
from batchbench.reports.model import KEY_METRICS, canonical

#: The label that numbers the repeats of one series (and the only label that may differ within it).
REPEAT_LABEL = "repeat"

SeriesKey = tuple[str, str, str, str, str]


def series_labels(row: dict[str, Any]) -> dict[str, Any]:
    """A run's labels without the repeat number: what its series is labelled with. A null label is no label (a
    report.json of an earlier batchbench lists labels never given as null)."""
    return {k: v for k, v in (row.get("labels") or {}).items() if k != REPEAT_LABEL and v is not None}


def series_key(row: dict[str, Any]) -> SeriesKey:
    """Engine, what it served and where (model, server arguments, version, URL), batching label, workload
    hash and the labels other than the repeat number."""
    return (str(row.get("engine")), canonical(row.get("serving") or {}), str(row.get("batching_label")),
            str((row.get("workload") or {}).get("hash")), canonical(series_labels(row)))


@dataclass
class Series:
    """Runs (report rows) that repeat one measurement."""

    rows: list[dict[str, Any]]

    @property
    def first(self) -> dict[str, Any]:
        return self.rows[0]

    def spread(self, metric: str) -> Estimate | None:
        """``metric`` over the runs that reported it: its mean and 95% interval."""
        return Estimate.of([v for row in self.rows if (v := num((row.get("metrics") or {}).get(metric))) is not None])

    def to_row(self) -> dict[str, Any]:
        """A row shaped like a run's (means under ``metrics``), plus their estimates and the runs they cover.

        Complete only when every run was: a mean over a cut-short run is flagged like the run itself.
        """
        statuses = sorted({str(row.get("status")) for row in self.rows})
        spreads = {spec.key: self.spread(spec.key) for spec in KEY_METRICS}
        return {
            "run_id": ", ".join(str(row.get("run_id")) for row in self.rows),
            "run_ids": [row.get("run_id") for row in self.rows],
            "repeats": len(self.rows),
            "engine": self.first.get("engine"),
            "batching_label": self.first.get("batching_label"),
            "workload": self.first.get("workload"),
            "labels": series_labels(self.first),
            "status": "complete" if statuses == ["complete"] else "/".join(statuses),
            "started_at": max(str(row.get("started_at") or "") for row in self.rows),
            "metrics": {key: s.value if s is not None else None for key, s in spreads.items()},
            "spread": codec.encode(spreads),
            "of_limit": self.of_limit(),
        }

    def of_limit(self) -> dict[str, Any] | None:
        """The runs' mean share of their own bound on paper, where every run has one of the same setup."""
        shares: list[dict[str, Any]] = [s for row in self.rows if (s := row.get("of_limit")) is not None]
        if not shares or len(shares) < len(self.rows) or len({(s["setup"], s["bound"]) for s in shares}) != 1:
            return None
        return shares[0] | {"share": sum(s["share"] for s in shares) / len(shares)}


def group_series(rows: list[dict[str, Any]]) -> list[Series]:
    """Rows grouped into series, in the order each series first appears."""
    groups: dict[SeriesKey, list[dict[str, Any]]] = defaultdict(list)
    seen: set[str] = set()
    for row in rows:
        run_id = str(row.get("run_id"))
        if run_id in seen:
            continue  # a copy of a run already counted (results copied into the folder twice) is not a repeat
        seen.add(run_id)
        groups[series_key(row)].append(row)
    return [Series(members) for members in groups.values()]
