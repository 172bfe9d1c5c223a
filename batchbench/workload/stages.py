"""Staged load: a run whose request rate changes as it goes, in stages held or ramped
(``--stages "rate=2:60s,ramp=2-8:30s,rate=8:60s"``).

Each stage is a Poisson process at its rate (a ramp's rate goes linearly from its first to its last value), drawn
by rescaling time: unit-rate exponential gaps laid out on the stages' cumulative rate, Λ(t) = ∫ rate, and mapped
back through Λ⁻¹ (exact for a held rate and, by the quadratic, for a linear ramp). So the sends are seeded, the same
for every engine, and each stage's share of them is what its rate and length say. Every request is sent at its
own offset (arrival kind ``timed``) and each stage's window is reported on its own (the run's ``stages``).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

_STAGE = re.compile(r"^(rate|ramp)=([0-9]*\.?[0-9]+)(?:-([0-9]*\.?[0-9]+))?:([0-9]*\.?[0-9]+)(s|m)?$")


@dataclass(frozen=True)
class Stage:
    """``duration_s`` of load at ``rate`` requests/s, or ramped from ``rate`` to ``rate_to`` (a ramp)."""

    rate: float
    duration_s: float
    #: The rate at the stage's end, for a ramp (None: held at ``rate``).
    rate_to: float | None = None

    def __post_init__(self) -> None:
        end = self.rate if self.rate_to is None else self.rate_to
        if self.rate_to is None and self.rate == 0:
            raise ValueError("a held stage needs a rate above 0 (a pause is not a stage)")
        if not (math.isfinite(self.rate) and math.isfinite(end)) or self.rate < 0 or end < 0 or self.rate + end == 0:
            raise ValueError(f"a stage's rates must be finite, not negative and not both 0, not {self.label}")
        if not self.duration_s > 0:
            raise ValueError(f"a stage lasts more than 0 s, not {self.duration_s}")

    @property
    def label(self) -> str:
        if self.rate_to is None:
            return f"rate={self.rate:g}:{self.duration_s:g}s"
        return f"ramp={self.rate:g}-{self.rate_to:g}:{self.duration_s:g}s"

    @property
    def expected_requests(self) -> float:
        """Its integral of the rate: the requests it sends on average."""
        end = self.rate if self.rate_to is None else self.rate_to
        return (self.rate + end) / 2 * self.duration_s

    def offset_at(self, area: float) -> float:
        """Seconds into the stage at which the cumulative rate reaches ``area`` (at most its expected requests)."""
        if area <= 0:
            return 0.0
        a, b, t = self.rate, self.rate if self.rate_to is None else self.rate_to, self.duration_s
        slope = (b - a) / t
        if abs(slope) < 1e-12:
            return area / a
        # area = a τ + slope τ² / 2, the root in [0, t] (the stable form: no cancellation when slope is small)
        return 2 * area / (a + math.sqrt(max(a * a + 2 * slope * area, 0.0)))


def parse_stages(text: str) -> tuple[Stage, ...]:
    """``rate=2:60s,ramp=2-8:30s,rate=8:2m`` → stages; ValueError naming the part that does not parse."""
    stages = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = _STAGE.match(part)
        if match is None:
            raise ValueError(f"--stages {text!r}: {part!r} is not rate=R:SECONDS or ramp=FROM-TO:SECONDS "
                             "(SECONDS with s or m, e.g. rate=2:60s,ramp=2-8:30s)")
        kind, first, last, length, unit = match.groups()
        if (kind == "ramp") != (last is not None):
            raise ValueError(f"--stages {text!r}: {part!r}: a ramp goes FROM-TO, a held rate has one value")
        try:
            stages.append(Stage(float(first), float(length) * (60 if unit == "m" else 1),
                                float(last) if last is not None else None))
        except ValueError as exc:
            raise ValueError(f"--stages {text!r}: {part!r}: {exc}") from None
    if not stages:
        raise ValueError("--stages: give at least one stage, e.g. rate=2:60s,rate=8:60s")
    return tuple(stages)


def boundaries(stages: tuple[Stage, ...]) -> list[float]:
    """Each stage's start and the last one's end, in seconds from the run's start."""
    edges = [0.0]
    for stage in stages:
        edges.append(edges[-1] + stage.duration_s)
    return edges


def schedule(stages: tuple[Stage, ...], rng: random.Random) -> list[float]:
    """Send offsets (seconds, microsecond-rounded, non-decreasing) over the stages, by time rescaling."""
    times: list[float] = []
    start = 0.0
    area = rng.expovariate(1.0)
    for stage in stages:
        while area <= stage.expected_requests:
            times.append(round(start + stage.offset_at(area), 6))
            area += rng.expovariate(1.0)
        area -= stage.expected_requests
        start += stage.duration_s
    return times
