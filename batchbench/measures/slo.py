"""Service-level objectives: ``ttft_p99=200ms,tpot_p99=50ms`` parsed once, checked against a run's summary.

An SLO is a set of objectives, each a latency statistic of one metric with a
limit: ``ttft_p99=200ms`` means the run's TTFT p99 must be at most 200 ms.
A run meets the SLO when every objective holds. The same objectives give the
per-request test for goodput: a request is good when its own TTFT and TPOT are
within the tightest TTFT and TPOT limits (what ``vllm bench serve --goodput``
and GuideLLM's constraints count), so goodput and "meets the SLO" never use
two definitions.

Written by hand because it is a dozen lines of parsing with errors that must
name the user's own text; no library parses this syntax.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from batchbench.measures.metrics import Distribution, Summary

#: Metric name -> the Summary field holding its distribution. ``ttfo``: time to the first token of the answer,
#: after a chat stream's reasoning (the TTFT of a stream that does not reason).
METRICS = {"ttft": "ttft", "ttfo": "ttfo", "tpot": "tpot", "itl": "itl", "e2e": "e2e"}
#: Statistic name -> the Distribution field.
STATS = {"p50": "p50", "p90": "p90", "p99": "p99", "mean": "mean", "max": "max"}
_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s|us)\s*$")


def parse_duration(text: str) -> float:
    """Seconds from ``200ms``, ``0.2s`` or ``500us``. A unit is required: a bare ``200`` is ambiguous."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration: write a number with a unit, e.g. 200ms or 0.2s")
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{text!r}: a latency limit must be more than 0")
    return value


@dataclass(frozen=True)
class Objective:
    """One objective: ``stat`` of ``metric`` at most ``limit_s`` seconds."""

    metric: str
    stat: str
    limit_s: float

    @property
    def name(self) -> str:
        """``ttft_p99``: the key it was written with, and the key figures are reported under."""
        return f"{self.metric}_{self.stat}"

    @property
    def quantile(self) -> float | None:
        """``0.99`` for a p99: a percentile objective, which a point judges on its requests pooled over its repeats;
        None for a mean or a max."""
        p = stat_percentile(self.stat)
        return None if p is None else p / 100

    def value(self, summary: Summary) -> float | None:
        """The run's value of this statistic, in its steady state where it has one (a closed loop: the opening
        burst of every client's first prompt at once is no state a server stays in); None when the run has no
        samples of the metric."""
        dist: Distribution | None = getattr(summary.steady or summary, METRICS[self.metric])
        return None if dist is None else float(getattr(dist, STATS[self.stat]))

    def __str__(self) -> str:
        return f"{self.name}<={_format_s(self.limit_s)}"


def stat_percentile(stat: str) -> float | None:
    """The percentile an SLO statistic is (``p99``: 99.0); None for one that needs no tail (mean, max)."""
    if stat not in STATS:
        raise ValueError(f"unknown statistic {stat!r}; one of {', '.join(STATS)}")
    return float(stat[1:]) if stat.startswith("p") else None


def _format_s(seconds: float, digits: int = 6) -> str:
    """``200ms``, ``2s``: a limit as the user wrote it (``digits`` 6), a measured value to 3 significant digits."""
    return f"{seconds * 1000:.{digits}g}ms" if seconds < 1 else f"{seconds:.{digits}g}s"


def _objective(key: str, limit: Any) -> Objective:
    metric, _, stat = key.partition("_")
    if metric not in METRICS or stat not in STATS:
        raise ValueError(f"not an objective: {key!r}")
    if isinstance(limit, bool) or not isinstance(limit, int | float) or not limit > 0:
        raise ValueError(f"objective {key}: a limit is a number of seconds above 0, not {limit!r}")
    return Objective(metric, stat, float(limit))


@dataclass(frozen=True)
class Verdict:
    """Whether one run met an SLO, and by how much each objective passed or failed."""

    met: bool
    #: Objective name -> the run's value (None: no samples, which fails the objective).
    values: dict[str, float | None]
    #: The objectives that failed, as ``ttft_p99=0.31s>200ms``: what a user reads first.
    failed: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"met": self.met, "values": dict(self.values), "failed": list(self.failed)}


@dataclass(frozen=True)
class Slo:
    """A set of objectives; parse with :meth:`parse`."""

    objectives: tuple[Objective, ...]

    @classmethod
    def parse(cls, text: str) -> Slo:
        """``ttft_p99=200ms,tpot_p99=50ms`` -> Slo. Raises ValueError naming the part that does not parse."""
        objectives: dict[str, Objective] = {}
        parts = [p.strip() for p in text.split(",")]
        if not text.strip() or any(not p for p in parts):
            raise ValueError(f"SLO {text!r}: expected METRIC_STAT=LIMIT[,...], e.g. ttft_p99=200ms,tpot_p99=50ms")
        for part in parts:
            key, sep, limit = part.partition("=")
            metric, _, stat = key.strip().partition("_")
            if not sep or metric not in METRICS or stat not in STATS:
                raise ValueError(
                    f"SLO part {part!r}: expected METRIC_STAT=LIMIT with METRIC one of {', '.join(METRICS)} and "
                    f"STAT one of {', '.join(STATS)}, e.g. ttft_p99=200ms"
                )
            if key.strip() in objectives:
                raise ValueError(f"SLO {text!r}: {key.strip()} is given twice")
            try:
                objectives[key.strip()] = Objective(metric, stat, parse_duration(limit))
            except ValueError as exc:
                raise ValueError(f"SLO part {part!r}: {exc}") from None
        return cls(tuple(objectives.values()))

    def __str__(self) -> str:
        return ",".join(str(o) for o in self.objectives)

    def check(self, summary: Summary) -> Verdict:
        """Every objective against the run: met only if each has a value within its limit."""
        return self.verdict({o.name: o.value(summary) for o in self.objectives})

    def verdict(self, values: dict[str, float | None]) -> Verdict:
        """Every objective against given values of its statistic (by objective name; missing or None: no
        samples). What :meth:`check` does with one run's figures, and what findings do with the medians of
        repeated runs, so a point over repeats is judged exactly as one run is."""
        values = {o.name: values.get(o.name) for o in self.objectives}
        def measured(value: float | None) -> str:
            return "no samples" if value is None else _format_s(value, 3)

        failed = tuple(
            f"{o.name}={measured(values[o.name])}>{_format_s(o.limit_s)}"
            for o in self.objectives
            if values[o.name] is None or values[o.name] > o.limit_s  # type: ignore[operator]
        )
        return Verdict(met=not failed, values=values, failed=failed)

    def request_limits(self) -> tuple[float | None, float | None]:
        """Per-request (TTFT, TPOT) limits for goodput: the tightest of each metric's objectives; None if none."""

        def tightest(metric: str) -> float | None:
            limits = [o.limit_s for o in self.objectives if o.metric == metric]
            return min(limits) if limits else None

        return tightest("ttft"), tightest("tpot")

    def to_dict(self) -> dict[str, Any]:
        return {o.name: o.limit_s for o in self.objectives}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Slo:
        """The inverse of :meth:`to_dict`; a results document of version 2 stored the per-request limits instead
        (``{"ttft_s": 0.2, "tpot_s": null}``), read as max objectives, which give the same goodput. ValueError on
        anything else."""
        if set(doc) <= {"ttft_s", "tpot_s"}:
            objectives = tuple(Objective(metric, "max", float(doc[f"{metric}_s"])) for metric in ("ttft", "tpot")
                               if doc.get(f"{metric}_s") is not None)
        else:
            objectives = tuple(_objective(key, value) for key, value in doc.items())
        return cls(objectives)

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """How :meth:`to_dict` looks in a results document."""
        return {"type": "object", "description": "seconds, by objective (METRIC_STAT, e.g. ttft_p99)",
                "additionalProperties": {"type": "number", "exclusiveMinimum": 0}}
