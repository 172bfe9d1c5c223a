"""The runs left out of every finding, each with its cause, and their count per cause.

A run judged invalid by :mod:`batchbench.analysis.validity` (requests failed, the machine or the client
distorted its timestamps, ...) is never used for a figure and never dropped: it is listed here with its
first reason's kind and every reason, and the answer counts the kinds, so a reader sees at once whether
the machine, the client or the engine was to blame.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from batchbench.analysis.findings.points import Point
from batchbench.analysis.validity import REASON_KINDS, ReasonKind


@dataclass(frozen=True)
class InvalidRun:
    engine: str
    layout: str
    concurrency: int
    run_id: str
    #: The kind of its first reason (:data:`batchbench.analysis.validity.REASON_KINDS`: "machine contention", ...).
    kind: ReasonKind
    reasons: tuple[str, ...]


def invalid_runs(points: Sequence[Point]) -> tuple[InvalidRun, ...]:
    return tuple(InvalidRun(p.engine, p.layout, p.concurrency, r.run_id, r.validity.kind, r.validity.reasons)
                 for p in points for r in p.runs if not r.valid and r.validity.kind is not None)


def by_kind(runs: Sequence[InvalidRun]) -> dict[str, int]:
    """How many runs of each kind, in the order :data:`batchbench.analysis.validity.REASON_KINDS` gives the kinds."""
    counts = Counter(r.kind for r in runs)
    return {kind: counts[kind] for kind in REASON_KINDS if counts[kind]}


def sentence(runs: Sequence[InvalidRun], total: int) -> str | None:
    """``3 of 96 runs invalid and left out (machine contention: 2, failed requests: 1); see the table.``"""
    if not runs:
        return None
    kinds = ", ".join(f"{kind}: {n}" for kind, n in by_kind(runs).items())
    return f"{len(runs)} of {total} runs invalid and left out of every finding ({kinds}); each is listed with why."
