"""The answer quotes, for every batch it names, that batch's own figures, and decides nothing on too few repeats.

Checked over generated curves (Hypothesis) and on the curves of a real main job run at half speed, the one whose
sweet-spot sentence once named batch 32 with batch 8's throughput and counted two-repeat points as within noise of
the peak (tests/data/halfspeed-curves.json says where it came from).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchbench.analysis.findings import Findings, findings_from_documents
from batchbench.measures.slo import Slo
from batchbench.results.document import RunDocument
from tests.answer_figures import mismatches
from tests.synthetic_runs import RunSpec, document

SLO = Slo.parse("ttft_p99=500ms")
LEVELS = (1, 2, 4, 8, 16, 32)
HALF_SPEED = Path(__file__).parent / "data" / "halfspeed-curves.json"


def _decides_nothing_on_thin_points(found: Findings) -> None:
    """No point too thin to decide on is the sweet spot, the peak, within noise of it, or an SLO verdict (a
    percentile's verdict needs its pooled interval on the deciding side); no interval of a positive figure reaches
    0."""
    for engine, e in found.engines.items():
        f = e.layouts["continuous"]
        thin = {p.concurrency for p in f.points if p.thin}
        if f.most_throughput is not None:
            assert not thin & {f.most_throughput.concurrency, *f.most_throughput.within_noise}, engine
            assert set(f.most_throughput.too_thin) == thin, engine
        if f.sweet_spot is not None:
            assert f.sweet_spot.concurrency not in thin
        for c, at in f.slo_points.items():
            for o in at.objectives:
                if o.pooled is not None:  # a percentile: judged on the requests pooled, decided only when bounded
                    limit, q = o.objective.limit_s, o.pooled
                    assert o.judgement != "meets" or (q.high is not None and q.high <= limit), (engine, c, o)
                    assert o.judgement != "fails" or (q.low is not None and q.low > limit), (engine, c, o)
                elif o.value is not None and o.value.n == 2 and (o.value.relative_half_width or 0) > 0.2:
                    assert o.judgement == "too few repeats", (engine, c, o)
        pool = f.latency_pool
        if pool is not None and pool.at is not None:
            assert pool.at.judgement == "meets"
        for p in f.points:
            for key in ("output_tok_s", "ttft_p99_s"):
                est = p.figure(key)
                assert est is None or est.low is None or est.low > 0, (engine, p.concurrency, key, est)


@st.composite
def curves(draw: st.DrawFn) -> list[RunDocument]:
    """A KV-limited engine's curve (throughput grows to the fit, then flat; TTFT grows past it), each point repeated
    1 to 4 times with run-to-run noise up to ±30%, summarised as closed loops (their steady state differs from the
    whole run)."""
    fit = draw(st.sampled_from((2, 4, 8, 16)))
    docs = []
    for c in LEVELS:
        base = min(c, fit) * 100.0 * draw(st.floats(0.8, 1.2))
        ttft = 0.02 + max(0.0, c / fit - 1) * 0.4
        docs += [document(RunSpec(
            concurrency=c, repeat=r, throughput=base * draw(st.floats(0.7, 1.3)),
            ttft=ttft * draw(st.floats(0.5, 1.5)), jitter=0.0, requests=40, closed_loop=True,
            send_span=draw(st.floats(0.1, 0.9)), kv_usage=0.95 if c > fit else 0.5,
            labels={"precision": 0.05, "kv_fit": fit})) for r in range(draw(st.integers(1, 4)))]
    return docs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(curves())
def test_every_figure_a_sentence_quotes_is_the_named_batchs_own(docs: list[RunDocument]) -> None:
    found = findings_from_documents(docs, slo=SLO)
    assert list(mismatches(found.to_dict())) == []
    _decides_nothing_on_thin_points(found)


def test_the_peak_the_sentence_names_is_the_one_whose_figures_it_quotes() -> None:
    """The steady state's ranking (what the sentences quote) differs from the whole runs': batch 16 has the most
    whole-run throughput, batch 8 the most in the steady state. The curve, the sweet spot and the peak are read from
    the steady state alone; once the peak came from one and its figures from the other."""
    shapes = {4: (700.0, 0.9), 8: (760.0, 0.5), 16: (800.0, 0.9)}  # whole-run tok/s, share of the run sending
    docs = [document(RunSpec(concurrency=c, repeat=r, throughput=whole * (1 + 0.005 * r), send_span=span,
                             requests=40, closed_loop=True, jitter=0.0, labels={"precision": 0.05}))
            for r in range(3) for c, (whole, span) in shapes.items()]
    found = findings_from_documents(docs, slo=SLO)
    steady = {c: found.layout("alpha", "continuous").point(c).figure("output_tok_s").value for c in shapes}
    assert max(steady, key=steady.__getitem__) == 8 != max(shapes, key=lambda c: shapes[c][0])
    assert list(mismatches(found.to_dict())) == []
    assert found.engines["alpha"].decisions.throughput.concurrency == 8


def _half_speed_documents() -> list[RunDocument]:
    data: dict[str, Any] = json.loads(HALF_SPEED.read_text(encoding="utf-8"))
    return [document(RunSpec(engine=engine, concurrency=int(c), repeat=run["repeat"], throughput=run["output_tok_s"],
                             ttft=run["ttft_p99_s"], jitter=0.0, requests=40, kv_usage=run["kv_usage_peak"],
                             labels={"precision": data["precision"], "kv_fit": 8}))
            for engine, points in data["engines"].items() for c, runs in points.items() for run in runs]


def test_the_half_speed_runs_answer_quotes_its_own_figures_and_leaves_two_repeat_points_undecided() -> None:
    found = findings_from_documents(_half_speed_documents(), slo=SLO)
    assert list(mismatches(found.to_dict())) == []
    _decides_nothing_on_thin_points(found)
    vllm = found.engines["vllm"].decisions
    # Batch 32 (two repeats, 732 [533-930]) and batch 1 (two repeats, a fifth of the peak) are no longer "within
    # noise" of batch 8; the sentence names the sweet spot with its own figures and says what it could not place.
    assert vllm.throughput is not None and vllm.throughput.concurrency == 8 and vllm.throughput.within_noise == (8,)
    assert {1, 32} <= set(vllm.throughput.too_thin)
    answer = vllm.answers(SLO)["throughput"]
    assert answer.startswith("batch 8: 751 [") and "too few repeats to place: batch 1, 2, 32" in answer
    # hf-continuous's batch 8 (TTFT p99 97.9 ms from two runs, once drawn down to 0) decides no SLO verdict: its
    # 80 requests pooled cannot bound a p99 (368 can), and no point below it has more.
    hfc = found.engines["hf-continuous"].layouts["continuous"]
    assert hfc.slo_points[8].judgement == "too few requests"
    assert hfc.latency_pool is not None and hfc.latency_pool.concurrency is None
    latency = found.engines["hf-continuous"].decisions.answers(SLO)["latency"]
    assert latency.startswith("none decided") and "too few requests to judge batch 1 (n=" in latency
    assert latency.endswith("a p99 needs 368")
    assert any(s.startswith("Too few repeats to decide") or "Too few repeats to decide" in s for s in found.answer)
