"""Findings from synthetic sweeps whose answers are known: the curve, the SLO, the ratios, the decisions."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest

from batchbench.analysis.findings import batching, findings_from_documents, points_from_documents
from batchbench.analysis.repeats import Estimate
from batchbench.analysis.theory import continuous_idle_fraction, waves_idle_fraction
from batchbench.core.config import ModelDescription
from batchbench.fixtures import tiny_model_dir
from batchbench.measures.metrics import meets_slos
from batchbench.measures.slo import Slo
from batchbench.results.discovery import discover
from batchbench.results.document import RunLabels
from batchbench.workload.requests import TokenCounts
from tests.synthetic_runs import RunSpec, document, sweep

SLO = Slo.parse("ttft_p99=200ms")


def layout(findings: Any, engine: str = "alpha", name: str = "continuous") -> Any:
    found = findings.layout(engine, name)
    assert found is not None, (engine, name)
    return found


def decisions(findings: Any, engine: str = "alpha") -> Any:
    return findings.engines[engine].decisions


# --------------------------------------------------------------------------- the curve


def test_the_memory_bound_finding_carries_the_planners_arithmetic_from_the_models_config() -> None:
    """The run's own figures (the tiny model's config.json, the cache's 2112 tokens in blocks of 32, 192 + 64-token
    sequences) give what the sweep was designed for: 1024 B per token (2 x 2 layers x 2 KV heads x 64 x 2 B), a
    sequence of 255 tokens held in 256, and 66 blocks // 8 blocks = 8 sequences; without a config, no plan."""
    docs = sweep(fit=8)
    for doc in docs:
        h = doc.header
        doc.header = dataclasses.replace(
            h, engine=dataclasses.replace(h.engine, model=ModelDescription(path=str(tiny_model_dir()))),
            workload=dataclasses.replace(h.workload, prompt_tokens=TokenCounts(192, 192, 192),
                                         output_tokens=TokenCounts(64, 64, 64)),
            labels=dataclasses.replace(h.labels, kv_capacity_tokens=2112, design={"block_size": 32}))
    found = findings_from_documents(docs)
    plan = layout(found).memory_bound.kv_plan
    assert (plan.kv_bytes_per_token, plan.sequence_tokens, plan.fit, plan.memory_bound_from) == (1024, 256, 8, 9)
    assert plan.kv_memory_bytes == 2112 * 1024
    assert decisions(found).answers(None)["memory"] == (
        "batch 16 (KV 95% full); the plan fits 8 sequences of 256 tokens in 2,112 tokens: as predicted")
    for doc in docs:
        doc.header = dataclasses.replace(doc.header, engine=dataclasses.replace(
            doc.header.engine, model=ModelDescription(path="a-hub-model-id")))
    assert layout(findings_from_documents(docs)).memory_bound.kv_plan is None


def test_the_known_sweep_has_its_knee_at_the_fit_and_memory_bound_past_it() -> None:
    f = layout(findings_from_documents(sweep(fit=8)))
    assert [p.regime for p in f.points] == ["under-utilised"] * 3 + ["sweet-spot", "memory-bound", "memory-bound"]
    assert f.sweet_spot.concurrency == 8 and not f.sweet_spot.end_of_sweep
    assert f.sweet_spot.output_tok_s.value == pytest.approx(800)
    assert f.memory_bound.concurrency == 16 and f.memory_bound.kv_usage_peak == 0.95
    assert f.memory_bound.kv_fit_predicted == 8 and f.memory_bound.predicted_onset == 16
    assert f.memory_bound.matches_prediction
    assert f.sweet_spot.evidence == ("alpha-continuous-c8-r0",)


def test_the_sentence_gives_the_curve_with_its_numbers() -> None:
    found = findings_from_documents(sweep(fit=8))
    assert ("alpha, continuous: under-utilised up to batch 4, sweet spot at 8 (800 (n=1) tok/s), "
            "memory-bound from 16 (KV 95% full; predicted fit 8).") in found.details


def test_a_sweep_that_still_scales_says_so() -> None:
    found = findings_from_documents(sweep(levels=(1, 2, 4), fit=8))
    f = layout(found)
    assert f.sweet_spot.concurrency == 4 and f.sweet_spot.end_of_sweep and f.memory_bound is None
    assert "still scaling at batch 4" in " ".join(found.details)
    assert decisions(found).answers(None)["memory"] == "not reached within the sweep"


def test_one_point_is_no_curve() -> None:
    found = findings_from_documents([document(RunSpec(concurrency=8))])
    f = layout(found)
    assert f.sweet_spot is None and f.memory_bound is None and f.points[0].regime is None
    assert f.most_throughput is None and f.no_curve and "no curve" in found.details[0]
    # One valid point is not "no valid point": the answer says why there is no curve.
    assert decisions(found).answers(SLO)["throughput"] == (
        "1 valid concurrency measured (8): no curve to read regimes from")


# --------------------------------------------------------------------------- most throughput


def test_the_sweet_spot_is_the_smallest_batch_within_the_peak_share_with_its_share_of_the_peak() -> None:
    """Past the fit throughput is flat: 16 and 32 cannot be told from 8 (their repeats overlap), and 8, the smallest
    within 10% of the most measured, is the sweet spot; the answer names it with its share of the peak."""
    found = findings_from_documents(sweep(fit=8, repeats=3))
    best = layout(found).most_throughput
    assert best.within_noise == (8, 16, 32)
    assert best.output_tok_s.n == 3 and best.output_tok_s.low < best.output_tok_s.value < best.output_tok_s.high
    sweet = layout(found).sweet_spot
    assert sweet.concurrency == 8
    answer = decisions(found).answers(None)["throughput"]
    assert answer.startswith("batch 8: ")
    if sweet.peak_concurrency is None:
        assert answer.endswith(", the most measured; more requests add latency, not throughput")
    else:
        assert sweet.share_of_peak.method == "t-ratio-paired" and 0.9 <= sweet.share_of_peak.value <= 1
        assert f"within 10% of the most measured (batch {sweet.peak_concurrency}: " in answer
        assert " of it); more requests add latency, not throughput" in answer


def test_the_sweet_spot_is_never_below_a_batch_the_answer_calls_as_good() -> None:
    """The throughput answer names exactly one batch as good as the peak with the least queueing: the sweet spot."""
    found = findings_from_documents(sweep(fit=8, repeats=3))
    d = decisions(found)
    answer = d.answers(None)["throughput"]
    assert answer.startswith(f"batch {d.sweet_spot.concurrency}: ")
    assert "within noise" not in answer and "knee" not in answer


# --------------------------------------------------------------------------- SLO, goodput, the latency pool


def test_the_most_goodput_under_the_slo_and_the_first_point_that_fails_it() -> None:
    found = findings_from_documents(sweep(fit=8, repeats=3), slo=SLO)
    f = layout(found)
    assert [f.slo_points[p.concurrency].judgement for p in f.points] == ["meets"] * 4 + ["fails"] * 2
    g = f.max_goodput
    assert g.concurrency == 8 and g.goodput_req_s.value == pytest.approx(80.0 * 1.02)  # 240 requests in ~2.9 s
    assert g.first_failing.concurrency == 16 and g.first_failing.failed()[0].startswith("ttft_p99 6")
    pool = f.latency_pool
    assert pool.concurrency == 8 and pool.stopped_at.concurrency == 16
    answer = decisions(found).answers(SLO)["latency"]
    assert answer.startswith("batch 8 (ttft_p99 ") and " vs 200 ms); batch 16: ttft_p99 " in answer
    assert answer.endswith("vs 200 ms (fails)")


def test_an_interval_that_straddles_the_limit_stops_the_latency_pool_and_says_so() -> None:
    """TTFT at 16 spreads evenly from 100 to 201 ms, so its p99 is about the 200 ms limit: the interval of the
    requests pooled over its repeats holds the limit, the data cannot tell, and the largest batch shown to hold the
    SLO is the one below it."""
    docs = [d for d in sweep(levels=(4, 8), repeats=3)]
    docs += [document(RunSpec(concurrency=16, repeat=r, throughput=800, ttft=0.1, jitter=1.0101)) for r in range(3)]
    f = layout(findings_from_documents(docs, slo=SLO))
    (at16,) = f.slo_points[16].objectives
    assert at16.pooled is not None and at16.pooled.n == 720 and at16.pooled.low < 0.2 < at16.pooled.high
    assert f.slo_points[16].judgement == "near the limit"
    assert f.latency_pool.concurrency == 8 and f.latency_pool.stopped_at.concurrency == 16


def test_a_loose_slo_lets_the_latency_pool_reach_the_largest_batch() -> None:
    found = findings_from_documents(sweep(fit=8, repeats=3), slo=Slo.parse("ttft_p99=10s"))
    f = layout(found)
    assert all(s.judgement == "meets" for s in f.slo_points.values())
    assert f.max_goodput.first_failing is None and f.latency_pool.stopped_at is None
    assert f.latency_pool.concurrency == 32 and decisions(found).answers(found.slo)["latency"].endswith(
        "the largest measured")


def test_an_slo_already_missed_at_the_lowest_batch_gives_no_latency_pool() -> None:
    found = findings_from_documents(sweep(fit=8, repeats=3), slo=Slo.parse("ttft_p99=1ms"))
    assert layout(found).latency_pool.concurrency is None
    assert decisions(found).answers(found.slo)["latency"].startswith("none: batch 1 already misses it (ttft_p99 ")


def test_without_an_slo_given_the_one_the_runs_were_measured_under_is_used() -> None:
    measured = [dataclasses.replace(d, header=dataclasses.replace(d.header, slo=SLO)) for d in sweep(fit=8, repeats=3)]
    found = findings_from_documents(measured)
    assert found.slo == SLO and layout(found).latency_pool.concurrency == 8
    # Runs measured under different SLOs name none the findings could take.
    mixed = measured[:9] + [dataclasses.replace(d, header=dataclasses.replace(d.header, slo=Slo.parse("ttft_p99=1s")))
                            for d in measured[9:]]
    assert findings_from_documents(mixed).slo is None
    assert findings_from_documents(mixed, slo=SLO).slo == SLO


def test_without_an_slo_there_is_no_goodput_and_no_latency_answer() -> None:
    found = findings_from_documents(sweep(fit=8))
    f = layout(found)
    assert f.max_goodput is None and f.latency_pool is None and f.slo_points == {}
    assert decisions(found).answers(None)["latency"] == "no SLO given"
    assert found.to_dict()["slo"] is None


def test_goodput_is_recounted_under_the_slo_given() -> None:
    # The run was measured without an SLO (no request counted as good); findings count under theirs.
    doc = document(RunSpec(concurrency=4, ttft=0.15, jitter=1.0))
    limit = 0.2
    good = sum(1 for r in doc.records if meets_slos(r, limit, None))
    assert 0 < good < len(doc.records)
    (point,) = points_from_documents([doc], slo=Slo.parse(f"ttft_p99={limit}s"))
    assert point.runs[0].summary.goodput == pytest.approx(good / doc.footer.duration_s)
    assert doc.footer.summary.good == len(doc.records)  # untouched: no SLO, every ok request


def test_a_percentile_its_samples_do_not_support_is_noted_and_judged_on_its_interval() -> None:
    """Three runs of 64 requests: each run's p99 is noted as near its maximum, and the 192 requests pooled bound
    the p99 below (batch 16 clearly fails) but not above: no batch is shown to hold the SLO, and the answer says
    what a p99 needs."""
    found = findings_from_documents(sweep(fit=8, requests=64, repeats=3), slo=SLO)
    f = layout(found)
    assert "ttft p99 of 64 requests is near their maximum" in (f.points[0].to_dict()["percentile_note"] or "")
    assert [f.slo_points[c].judgement for c in (1, 8, 16)] == ["too few requests"] * 2 + ["fails"]
    assert f.latency_pool.concurrency is None and f.latency_pool.stopped_at.concurrency == 16
    answer = decisions(found).answers(SLO)["latency"]
    assert answer.startswith("none decided; batch 16: ttft_p99 ") and answer.endswith(": a p99 needs 368")
    assert "too few requests to judge batch 1 (n=192), 2 (n=192), 4 (n=192), 8 (n=192)" in answer
    # What deciding it would take: the requests batch 8, the largest that could hold it, lacks, and the time.
    assert decisions(found).tail_short is not None and decisions(found).tail_short.lacking == 368 - 192
    assert any("could hold the SLO lacks (alpha 176 at batch 8) take about " in s for s in found.answer)


# --------------------------------------------------------------------------- invalid points and repeats


def test_an_invalid_point_is_kept_flagged_and_left_out_of_the_curve() -> None:
    docs = sweep(fit=8, requests=400)  # enough to bound each point's p99 against the SLO
    docs[3] = document(RunSpec(concurrency=8, throughput=800, failed=5, kv_usage=0.7, labels={"kv_fit": 8}))
    found = findings_from_documents(docs, slo=SLO)
    f = layout(found)
    bad = f.point(8)
    assert not bad.valid and bad.regime is None and f.slo_points[8].judgement == "unknown"
    assert bad.invalid_reasons == ("5 of 240 requests failed (timeout 5)",)
    assert f.sweet_spot.concurrency != 8 and f.max_goodput.concurrency != 8
    (gone,) = found.invalid_runs
    assert (gone.engine, gone.layout, gone.concurrency, gone.kind) == ("alpha", "continuous", 8, "failed requests")
    assert found.to_dict()["invalid_by_kind"] == {"failed requests": 1}
    assert ("1 of 6 runs invalid and left out of every finding (failed requests: 1); each is listed with why."
            in found.answer)


def test_repeats_give_the_t_interval_and_an_invalid_repeat_is_excluded_not_dropped() -> None:
    docs = sweep(levels=(4, 8), repeats=3)
    f = layout(findings_from_documents(docs))
    tok = f.point(4).figure("output_tok_s")
    assert tok == Estimate.of([400.0, 408.0, 416.0])
    assert (tok.method, tok.n) == ("t-log", 3) and tok.value == pytest.approx(408.0)
    # One repeat disturbed: the point stands on the other two, and says which run it left out.
    docs[2] = document(RunSpec(concurrency=4, repeat=1, throughput=100, foreign=0.5, labels={"kv_fit": 8}))
    found = findings_from_documents(docs)
    four = layout(found).point(4)
    assert four.valid and four.figure("output_tok_s") == Estimate.of([400.0, 416.0])
    assert four.excluded_runs[0][0] == "alpha-continuous-c4-r1" and "machine's CPU" in four.excluded_runs[0][1][0]
    assert [r.kind for r in found.invalid_runs] == ["machine busy"]


def test_a_point_says_whether_it_reached_its_precision_target() -> None:
    def labelled(repeats: int, target: float) -> list[Any]:
        docs = sweep(levels=(4, 8), repeats=repeats)
        for doc in docs:
            doc.header = dataclasses.replace(doc.header, labels=dataclasses.replace(doc.header.labels,
                                                                                     precision=target))
        return docs

    f = layout(findings_from_documents(labelled(3, 0.05)))
    assert f.point(4).precision_target == 0.05 and f.point(4).precise  # ±2% repeats, n=3: within ±5%
    docs = labelled(2, 0.01)
    found = findings_from_documents(docs)
    assert layout(found).point(4).precise is False
    assert decisions(found).imprecise == (4, 8)
    assert found.answer[-1].startswith("Not within ±1% in the time budget (wider intervals, shown as measured): "
                                       "alpha at 4, 8.")
    assert layout(findings_from_documents(sweep(levels=(4, 8)))).point(4).precise is None  # no target set


# --------------------------------------------------------------------------- continuous vs static, engines, padding


def mixed_outputs() -> list[int]:
    rng = random.Random(3)
    return [rng.randint(4, 48) for _ in range(48)]


def layouts(engine: str, continuous: list[float], static: list[float], outputs: list[int]) -> list[Any]:
    docs = []
    for r, (c, s) in enumerate(zip(continuous, static)):
        docs.append(document(RunSpec(engine=engine, concurrency=8, repeat=r, throughput=c, outputs=outputs,
                                     decoding=0.1)))
        docs.append(document(RunSpec(engine=engine, layout="static-waves", concurrency=8, repeat=r, throughput=s,
                                     outputs=outputs, decoding=0.06, wave=1)))
    return docs


def test_continuous_over_static_with_its_mechanism() -> None:
    outputs = mixed_outputs()
    found = findings_from_documents(layouts("alpha", [140, 150, 160], [100, 105, 110], outputs))
    cos = found.engines["alpha"].continuous_over_static
    at = cos.at[8]
    # Measured pass by pass side by side, the ratio is paired: each pass's two runs shared the machine's state.
    assert at.ratio == Estimate.paired_ratio([(140, 100), (150, 105), (160, 110)])
    assert at.ratio.method == "t-ratio-paired" and at.ratio.differs_from_one and not at.within_noise
    assert at.mean_decoding == pytest.approx(4.8) and at.static_mean_decoding == pytest.approx(2.88)
    assert at.ideal_mean_decoding == pytest.approx(8 * (1 - continuous_idle_fraction(outputs, 8)))
    assert at.ideal_static_mean_decoding == pytest.approx(8 * (1 - waves_idle_fraction(outputs, 8)))
    assert decisions(found).answers(None)["batching"] == (
        f"continuous at batch 8: x1.43 [{at.ratio.low:.2f}–{at.ratio.high:.2f}] the throughput of static waves; 4.8 "
        f"requests decoding on average vs 2.9 (ideal {at.ideal_mean_decoding:.1f} vs "
        f"{at.ideal_static_mean_decoding:.1f})")


def test_static_waves_ahead_are_named_as_the_winner() -> None:
    """llama.cpp's server on a toy model: its static waves outran its continuous batching, and the sentence says
    which won without calling the winner a fraction of itself."""
    found = findings_from_documents(layouts("alpha", [100, 105, 110], [140, 150, 160], mixed_outputs()))
    at = found.engines["alpha"].continuous_over_static.at[8]
    assert decisions(found).answers(None)["batching"].startswith(
        f"static waves at batch 8: continuous gives only x0.70 [{at.ratio.low:.2f}–{at.ratio.high:.2f}] their "
        "throughput")


def test_a_machine_drift_both_layouts_share_cancels_in_the_paired_ratio() -> None:
    """Each pass ran 5% faster continuous than static while the machine drifted 20% between passes: the
    unpaired intervals overlap, the paired ratio finds the 5%."""
    found = findings_from_documents(layouts("alpha", [105, 115.5, 126], [100, 110, 120], mixed_outputs()))
    ratio = found.engines["alpha"].continuous_over_static.headline.ratio
    assert ratio.differs_from_one and ratio.value == pytest.approx(1.05)
    assert Estimate.of([105, 115.5, 126]).ratio(Estimate.of([100, 110, 120])).differs_from_one is False


def test_overlapping_layouts_are_within_noise_with_the_largest_difference_left_open() -> None:
    found = findings_from_documents(layouts("alpha", [100, 120, 110], [115, 95, 105], mixed_outputs()))
    cos = found.engines["alpha"].continuous_over_static
    assert cos.headline.within_noise
    assert found.to_dict()["engines"]["alpha"]["continuous_over_static"]["headline"]["within_noise"] is True
    open_share = cos.headline.ratio.largest_undetected
    # Wider than the ±5% asked (the default): undecided, not "no difference", with its cause.
    assert decisions(found).answers(None)["batching"].startswith(
        "at batch 8, undecided: x1.05 [")
    assert f"holds 1 but leaves open differences up to {open_share:.0%}, more than the ±5% asked (the runs' own " \
        "spread over n=3); more repeats would decide it" in decisions(found).answers(None)["batching"]
    # At a precision that wide, the same ratio is a finding: no difference beyond it.
    loose = dataclasses.replace(cos, at={8: dataclasses.replace(cos.headline, precision=0.7)})
    assert batching.decision(loose).startswith(f"no difference larger than {open_share:.0%} detected at batch 8")
    assert cos.headline.ratio.method == "t-ratio-paired"
    # Continuous kept more requests decoding (0.1 of the run each, against 0.06), for no throughput: the TPOTs
    # say each step cost more.
    assert "but at TPOT p50 " in decisions(found).answers(None)["batching"]
    assert "each step cost more with more requests in it (compute-bound)" in decisions(found).answers(None)["batching"]


def test_without_static_waves_the_comparison_says_it_cannot_be_made() -> None:
    found = findings_from_documents(sweep(levels=(4, 8)))
    assert found.engines["alpha"].continuous_over_static is None
    assert decisions(found).answers(None)["batching"] == "cannot be compared (no static-waves run)"


def test_engines_are_compared_at_their_best_with_an_interval() -> None:
    docs = sweep(fit=8, repeats=3) + sweep(fit=8, repeats=3, per_slot=50.0, engine="beta")
    found = findings_from_documents(docs)
    (c,) = found.comparisons
    assert (c.metric, c.layout, c.a, c.b, c.verdict) == ("most throughput", "continuous", "alpha", "beta",
                                                         "alpha ahead")
    assert c.ratio.value == pytest.approx(2.0) and c.ratio.differs_from_one
    assert c.sentence().startswith("Under continuous load, alpha gives x2.00 [")
    assert c.sentence().endswith("; on a CPU: framework overhead decides this, it does not carry over to a GPU or "
                                 "a real model.")
    assert "the output tokens/s of beta, each at its best batch size (" in c.sentence()
    # In the details the pair is said without the scope: the pick says it once for every engine.
    assert c.sentence(caveat=False) in found.details and c.sentence() not in found.details
    # The other way round, the winner is named first and the ratio inverted with its interval.
    flipped = findings_from_documents(sweep(fit=8, repeats=3, per_slot=50.0) + sweep(fit=8, repeats=3, engine="beta"))
    (f,) = flipped.comparisons
    assert f.verdict == "beta ahead" and f.ratio.value == pytest.approx(0.5)
    assert f.sentence().startswith("Under continuous load, beta gives x2.00 [")
    assert "of alpha, each at" in f.sentence()


def test_engines_that_cannot_be_told_apart_say_the_largest_difference_left_open() -> None:
    docs = sweep(fit=8, repeats=3) + sweep(fit=8, repeats=3, engine="beta", per_slot=101.0)
    (c,) = findings_from_documents(docs).comparisons
    # Within ±5% (the precision asked) the interval leaves more open: undecided, and said with its cause.
    assert c.verdict == "undecided" and "undecided: x" in c.sentence() and "more than the ±5% asked" in c.sentence()
    loose = dataclasses.replace(c, precision=0.5)
    assert loose.verdict == "within noise" and "no difference larger than" in loose.sentence()


def test_padding_cost_predicted_and_measured() -> None:
    long, short = 1024, 25
    docs = []
    for r in range(3):
        docs += [
            document(RunSpec(layout="padded-mixed", concurrency=32, repeat=r, requests=32,
                             prompts=[long] + [short] * 31, ttft=1.0 + 0.01 * r, wave=1,
                             engine_report={"prompt_pad_fraction": 0.945})),
            document(RunSpec(layout="homogeneous", concurrency=32, repeat=r, requests=32, prompts=[short] * 32,
                             ttft=0.1, wave=1)),
        ]
    found = findings_from_documents(docs)
    cost = found.engines["alpha"].padding_cost.at[32]
    assert cost.padded_fraction_predicted == pytest.approx(31 * (long - short) / (32 * long))
    assert cost.real_token_ratio == pytest.approx((long + 31 * short) / (32 * short))
    assert cost.padded_token_ratio == pytest.approx(32 * long / (32 * short))
    assert cost.latency_ratio.value == pytest.approx(10, rel=0.15) and cost.pays_for_padding
    assert cost.measured_pad_fraction == 0.945
    answer = decisions(found).answers(None)["padding"]
    assert answer.startswith("one long prompt in a batch of 32 takes x")
    assert answer.endswith("95% of its prompt slots are padding (the engine reports 94%): it pays for the padded "
                           "slots")
    # An engine that packs its batches pays no more than the real tokens: the same pair, the latency unmoved.
    packed = [d for d in docs if d.header.labels.layout == "homogeneous"] + [
        document(RunSpec(layout="padded-mixed", concurrency=32, repeat=r, requests=32, prompts=[long] + [short] * 31,
                         ttft=0.1 * (1 + 0.01 * r), wave=1)) for r in range(3)]
    packed_answer = decisions(findings_from_documents(packed)).answers(None)["padding"]
    # In its own terms: it reports no padding, so what the long prompt cost it, beside what padding would have made.
    assert "for 2.2x its real prompt tokens (it reports no padding; padded to the longest they would be 41.0x)" \
        in packed_answer
    assert packed_answer.endswith(": what those tokens explain: it does not pay for padding")
    assert "of its prompt slots are padding" not in packed_answer


# --------------------------------------------------------------------------- the document shape and entry points


def test_to_dict_is_strict_json_with_the_decisions_first() -> None:
    docs = sweep(fit=8, repeats=2) + layouts("alpha", [900, 910], [600, 610], mixed_outputs())
    found = findings_from_documents(docs, slo=SLO).to_dict()
    assert list(found)[:5] == ["slo", "questions", "decisions", "answer", "details"]
    assert found["slo"] == {"ttft_p99": 0.2}
    (d,) = found["decisions"]
    assert set(d["answers"]) == set(found["questions"]) == {"throughput", "latency", "batching", "padding", "memory"}
    point = found["engines"]["alpha"]["layouts"]["continuous"]["points"][0]
    assert set(point["output_tok_s"]) == {"value", "low", "high", "n", "method", "sd", "confidence"}
    assert point["slo"]["judgement"] == "meets"
    json.dumps(found, allow_nan=False)


def test_an_engine_under_two_batching_configs_is_two_curves() -> None:
    docs = sweep(levels=(4, 8)) + sweep(levels=(4, 8), batching={"mode": "static", "max_batch_size": 8})
    assert len(findings_from_documents(docs).engines) == 2


def test_findings_from_a_run_folder_name_what_they_skipped(tmp_path: Path) -> None:
    docs = sweep(levels=(2, 4, 8, 16))
    for doc in docs:
        (tmp_path / f"{doc.header.run_id}.json").write_text(doc.to_json(), encoding="utf-8")
    odd = document(RunSpec(arrival="poisson"))
    odd.header = dataclasses.replace(odd.header, labels=RunLabels())
    (tmp_path / "open-loop.json").write_text(odd.to_json(), encoding="utf-8")
    found = findings_from_documents(discover(tmp_path).documents, slo=SLO)
    assert found.engines.keys() == {"alpha"}
    assert [p.run_ids for p in layout(found).points] == [(f"alpha-continuous-c{c}-r0",) for c in (2, 4, 8, 16)]
    assert len(found.skipped) == 1 and found.skipped[0].startswith("open-loop.json: no layout and concurrency")
    assert str(tmp_path) not in json.dumps(found.to_dict())


def test_a_suite_filter_keeps_only_that_suites_runs() -> None:
    other = document(RunSpec(engine="beta", concurrency=8, labels={"suite": "static_vs_continuous"}))
    found = findings_from_documents([*sweep(levels=(4, 8)), other], suite="main")
    assert found.engines.keys() == {"alpha"}
    assert findings_from_documents([*sweep(levels=(4, 8)), other]).engines.keys() == {"alpha", "beta"}


def test_an_engine_that_served_other_lengths_is_named_with_the_first_difference() -> None:
    docs = sweep(levels=(1, 2))
    for doc in docs:
        for i, record in enumerate(doc.records):
            record.prompt_tokens = record.prompt_len + (1 if i == 3 else 0)  # one request got a BOS token more
    found = findings_from_documents(docs)
    served = found.parity["alpha"]
    assert (served.checked, served.prompt_mismatches, served.output_mismatches) == (480, 2, 0)
    assert found.to_dict()["parity"]["alpha"]["ok"] is False
    assert any(s.startswith("alpha: workload parity: 2 of 480 requests' prompt token counts differ") and
               "request w-00003: prompt 17 tokens, workload 16" in s for s in found.details)
    assert findings_from_documents(sweep(levels=(1, 2))).parity["alpha"].ok  # no counts reported: nothing to flag


def test_lora_runs_get_a_sentence_on_whether_their_adapters_were_served_alike() -> None:
    from batchbench.measures.metrics import summarize

    docs = []
    for repeat in range(2):
        doc = document(RunSpec(engine="alpha", concurrency=4, repeat=repeat, requests=40))
        # Two adapters; "b"'s requests waited four times as long for their first token.
        records = [dataclasses.replace(r, lora="a" if i % 2 else "b",
                                       chunk_times=[t + (0.15 if i % 2 == 0 else 0.0) for t in r.chunk_times])
                   for i, r in enumerate(doc.records)]
        assert doc.footer is not None and doc.footer.duration_s is not None
        summary = summarize(records, duration_s=doc.footer.duration_s)
        docs.append(dataclasses.replace(doc, records=records, footer=dataclasses.replace(doc.footer, summary=summary)))
    found = findings_from_documents(docs)
    (sentence,) = [d for d in found.details if "LoRA adapters" in d]
    assert sentence.startswith("alpha continuous at 4: 2 LoRA adapters, TTFT p50 from ")
    assert "(a) to " in sentence and "(b)" in sentence and "Jain's fairness of their request speeds" in sentence
    assert not [d for d in findings_from_documents([document(RunSpec())]).details if "LoRA" in d]


def test_a_plateau_with_the_cache_not_full_is_compute_saturated_not_memory_bound() -> None:
    """Flat from batch 2 with the cache a quarter full: no sentence calls it memory-bound (issue 28's slow run)."""
    docs = [document(RunSpec(concurrency=c, repeat=r, throughput=t * (1 + 0.01 * r), kv_usage=kv, jitter=0.0))
            for r in range(3) for c, t, kv in [(1, 100, 0.05), (2, 180, 0.25), (4, 185, 0.4), (8, 182, 0.6)]]
    found = findings_from_documents(docs)
    f = layout(found)
    assert [p.regime for p in f.points] == ["under-utilised", "sweet-spot", "compute-saturated", "compute-saturated"]
    answer = decisions(found).answers(None)["memory"]
    assert answer.startswith("not memory-bound within the sweep: compute-saturated from batch 4 (KV at most 60% full")
    assert "memory-bound from" not in " ".join(found.details)
    assert decisions(found).answers(None)["throughput"].startswith("batch 2: ")  # the sweet spot, within 10% of 185
