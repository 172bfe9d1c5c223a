"""Reads every figure the answer's sentences quote about a batch and checks it against that batch's own figures in
report.json: a sentence that names batch 32 and quotes batch 8's throughput (as one did at half speed) is caught.

Shared by the Hypothesis test over generated curves and the regression test on a real run's curves
(tests/test_answer_figures.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from batchbench.analysis.findings.text import ms_estimate, ms_quantile, tok
from batchbench.analysis.quantiles import Quantile
from batchbench.analysis.repeats import Estimate
from batchbench.core import codec

#: A figure as the sentences write it (an en dash between the ends): ``751 [688-820]`` or ``800 (n=1)``.
_FIGURE = r"(\S+ (?:\[[^\]]*\]|\(n=\d+\)))"
#: Throughput quoted for a batch: ``batch 8: 751 [688-820] tok/s`` (the answer), ``sweet spot at 8 (751 [...] tok/s``
#: (the details).
_TOK = [re.compile(r"batch (\d+): " + _FIGURE + " tok/s"), re.compile(r"sweet spot at (\d+) \(" + _FIGURE + " tok/s")]
#: TTFT p99 quoted for a batch: ``batch 8 (ttft_p99 50.0 [42.9-58.2] ms`` or ``batch 16: ttft_p99 640 [...] ms``.
_TTFT = re.compile(r"batch (\d+)(?: \(|: )ttft_p99 " + _FIGURE + " ms")
#: The sweet spot's share of the peak: ``batch 8: ... within 10% of the most measured (batch 32: ... tok/s,
#: x0.95 [0.90-1.01] of it)``.
_SHARE = re.compile(r"^batch (\d+):.*\(batch (\d+): [^()]*tok/s, x([\d.]+)")


def _estimate(encoded: Mapping[str, Any] | None) -> Estimate | None:
    return None if encoded is None else codec.decode(Estimate, encoded)


def mismatches(report: Mapping[str, Any], layout: str = "continuous") -> Iterator[str]:
    """Every figure a sentence of ``report`` (report.json's ``findings``, or :meth:`Findings.to_dict`) quotes for a
    batch that is not that batch's own in the same document, one line each; nothing when they all agree."""
    for engine, found in report["engines"].items():
        points = {p["concurrency"]: p for p in found["layouts"].get(layout, {}).get("points", [])}
        decision = next(d for d in report["decisions"] if d["engine"] == engine)
        sentences = [*decision["answers"].values(),
                     *(s for s in report["details"] if s.startswith(f"{engine}, {layout}"))]
        for sentence in sentences:
            yield from _check(engine, sentence, points)


def _check(engine: str, sentence: str, points: Mapping[int, Mapping[str, Any]]) -> Iterator[str]:
    for pattern in _TOK:
        for c, quoted in pattern.findall(sentence):
            own = _estimate(points[int(c)]["output_tok_s"])
            if own is None or own.format(tok) != quoted:
                yield f"{engine}: batch {c} quoted at {quoted} tok/s, its own: {own and own.format(tok)}: {sentence}"
    for c, quoted in _TTFT.findall(sentence):
        slo = points[int(c)].get("slo") or {}
        objective = next((o for o in slo.get("objectives", []) if o["objective"] == "ttft_p99"), {})
        # Judged on the pooled percentile where the runs' records gave one, else on the runs' own values.
        if (tail := objective.get("pooled")) is not None:
            own_text = ms_quantile(codec.decode(Quantile, tail))
        else:
            own = _estimate(objective.get("value"))
            own_text = None if own is None else ms_estimate(own)
        if own_text != quoted + " ms":
            yield f"{engine}: batch {c} quoted at ttft_p99 {quoted} ms, its own: {own_text}: {sentence}"
    if (m := _SHARE.search(sentence)) is not None:
        sweet, peak = (_estimate(points[int(c)]["output_tok_s"]) for c in m.group(1, 2))
        if sweet is None or peak is None or abs(float(m.group(3)) - sweet.value / peak.value) > 0.006:
            yield f"{engine}: batch {m.group(1)} quoted at x{m.group(3)} of batch {m.group(2)}: {sentence}"
