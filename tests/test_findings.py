"""Findings from synthetic sweeps whose answers are known: the curve, the SLO, the ratios, the sentences."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchbench.findings import (
    Estimate,
    bootstrap,
    findings_from_dir,
    findings_from_documents,
    points_from_documents,
)
from batchbench.fixtures import tiny_model_dir
from batchbench.metrics import meets_slos, percentile
from batchbench.slo import Slo
from tests.synthetic_runs import RunSpec, document, sweep

SLO = Slo.parse("ttft_p99=200ms")


# --------------------------------------------------------------------------- intervals

positive = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False)


@st.composite
def estimates(draw: Any) -> Estimate:
    values = sorted(draw(st.lists(positive, min_size=3, max_size=3)))
    return Estimate(values[1], values[0], values[2], 3, draw(st.sampled_from(["repeats", "bootstrap"])))


@given(st.lists(positive, min_size=1, max_size=12))
def test_repeats_give_the_median_and_the_range(values: list[float]) -> None:
    found = Estimate.of_repeats(values)
    assert found is not None and found.method == "repeats" and found.n == len(values)
    assert found.low == min(values) <= found.median <= found.high == max(values)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), min_size=1, max_size=60),
       st.integers(min_value=0, max_value=2**32))
def test_bootstrap_contains_its_median_and_is_deterministic(values: list[float], seed: int) -> None:
    def stats(xs: list[float]) -> dict[str, float | None]:
        return {"p99": percentile(xs, 99), "sum": math.fsum(xs)}

    first = bootstrap(values, stats, seed=seed, resamples=50)
    assert first == bootstrap(values, stats, seed=seed, resamples=50)
    for name, found in first.items():
        assert found is not None and found.method == "bootstrap" and found.n == len(values)
        assert found.low <= found.median <= found.high
        assert found.median == stats(values)[name]  # the run's own statistic, not a resampled one


def test_bootstrap_of_an_undefined_statistic_is_none() -> None:
    found = bootstrap([1.0, 2.0], lambda xs: {"none": None}, seed=1, resamples=10)
    assert found == {"none": None}


@given(estimates(), estimates())
def test_a_ratio_spans_every_quotient_of_its_intervals(a: Estimate, b: Estimate) -> None:
    r = a.ratio(b)
    assert r is not None
    assert r.median == a.median / b.median
    for x in (a.low, a.median, a.high):
        for y in (b.low, b.median, b.high):
            assert r.low * (1 - 1e-12) <= x / y <= r.high * (1 + 1e-12)
    assert r.within_noise == (r.low <= 1 <= r.high)
    assert r.method == ("repeats" if a.method == b.method == "repeats" else "bootstrap")


@given(estimates())
def test_an_estimate_against_itself_is_within_noise(a: Estimate) -> None:
    ratio = a.ratio(a)
    assert ratio is not None and ratio.within_noise and ratio.median == 1.0


def test_a_ratio_to_nothing_is_none_and_an_open_end_is_null_in_json() -> None:
    a = Estimate(2.0, 1.0, 3.0, 3, "repeats")
    assert a.ratio(Estimate(0.0, 0.0, 0.0, 3, "repeats")) is None
    open_ended = a.ratio(Estimate(1.0, 0.0, 2.0, 3, "repeats"))
    assert open_ended is not None and open_ended.to_dict()["high"] is None
    with pytest.raises(ValueError):
        Estimate(1.0, 2.0, 3.0, 1, "repeats")


# --------------------------------------------------------------------------- the curve


def layout(findings: Any, engine: str = "alpha", name: str = "continuous") -> Any:
    found = findings.layout(engine, name)
    assert found is not None, (engine, name)
    return found


def test_the_memory_bound_finding_carries_the_planners_arithmetic_from_the_models_config() -> None:
    """The run's own figures (the tiny model's config.json, the cache's 2112 tokens in blocks of 32, 192 + 64-token
    sequences) give what the sweep was designed for: 1024 B per token (2 x 2 layers x 2 KV heads x 64 x 2 B), a
    sequence of 255 tokens held in 256, and 66 blocks // 8 blocks = 8 sequences; without a config, no plan."""
    docs = sweep(fit=8)
    for doc in docs:
        doc.header.engine["model"] = {"path": str(tiny_model_dir())}
        doc.header.workload.update(prompt_tokens={"max": 192}, output_tokens={"max": 64})
        doc.header.labels.update(kv_capacity_tokens=2112, design={"block_size": 32})
    plan = layout(findings_from_documents(docs)).memory_bound_from.kv_plan
    assert (plan.kv_bytes_per_token, plan.sequence_tokens, plan.fit, plan.memory_bound_from) == (1024, 256, 8, 9)
    assert plan.kv_memory_bytes == 2112 * 1024
    for doc in docs:
        doc.header.engine["model"] = {"path": "a-hub-model-id"}
    assert layout(findings_from_documents(docs)).memory_bound_from.kv_plan is None


def test_the_known_sweep_has_its_knee_at_the_fit_and_memory_bound_past_it() -> None:
    f = layout(findings_from_documents(sweep(fit=8)))
    assert [p.regime for p in f.points] == ["under-utilised"] * 3 + ["sweet-spot", "memory-bound", "memory-bound"]
    assert f.sweet_spot.concurrency == 8 and not f.sweet_spot.end_of_sweep
    assert f.sweet_spot.output_tok_s.median == pytest.approx(800)
    assert f.memory_bound_from.concurrency == 16 and f.memory_bound_from.kv_usage_peak == 0.95
    assert f.memory_bound_from.kv_fit_predicted == 8 and f.memory_bound_from.predicted_onset == 16
    assert f.sweet_spot.evidence == ("alpha-continuous-c8-r0",)


def test_the_sentence_gives_the_curve_with_its_numbers() -> None:
    found = findings_from_documents(sweep(fit=8))
    assert ("alpha, continuous: under-utilised up to batch 4, sweet spot at 8 (800 [800–800] tok/s), "
            "memory-bound from 16 (KV 95% full; predicted fit 8).") in found.sentences


def test_a_sweep_that_still_scales_says_so() -> None:
    f = layout(findings_from_documents(sweep(levels=(1, 2, 4), fit=8)))
    assert f.sweet_spot.concurrency == 4 and f.sweet_spot.end_of_sweep and f.memory_bound_from is None
    assert "still scaling at batch 4" in " ".join(findings_from_documents(sweep(levels=(1, 2, 4))).sentences)


def test_one_point_is_no_curve() -> None:
    found = findings_from_documents([document(RunSpec(concurrency=8))])
    f = layout(found)
    assert f.sweet_spot is None and f.memory_bound_from is None and f.points[0].regime is None
    assert f.no_curve and "no curve" in found.sentences[0]
    assert f.recommended.latency_pool_max_num_seqs is None and f.recommended.throughput_pool_concurrency is None


# --------------------------------------------------------------------------- SLO, goodput, recommendations


def test_the_most_goodput_under_the_slo_and_the_first_point_that_fails_it() -> None:
    found = findings_from_documents(sweep(fit=8), slo=SLO)
    f = layout(found)
    assert [p.meets_slo for p in f.points] == [True, True, True, True, False, False]
    g = f.max_goodput_under_slo
    assert g.concurrency == 8 and g.goodput_req_s.median == pytest.approx(80.0)  # 240 requests in 3 s
    assert g.first_failing[0] == 16 and g.first_failing[1][0].startswith("ttft_p99=") and "ms>200ms" in \
        g.first_failing[1][0]
    assert f.recommended.latency_pool_max_num_seqs == 8 and f.recommended.throughput_pool_concurrency == 8
    text = " ".join(found.sentences)
    assert "under ttft_p99<=200ms: the most goodput is at batch 8 (80.0 [80.0–80.0] req/s, 800 tok/s); " \
           "batch 16 fails it (ttft_p99=" in text


def test_a_loose_slo_lets_the_latency_pool_grow_but_not_the_throughput_pool() -> None:
    f = layout(findings_from_documents(sweep(fit=8), slo=Slo.parse("ttft_p99=10s")))
    assert all(p.meets_slo for p in f.points)
    assert f.max_goodput_under_slo.first_failing is None
    # Goodput is flat past the knee: the tie goes to the smallest batch, and regime 3 never hosts the throughput pool.
    assert f.max_goodput_under_slo.concurrency == 8
    assert f.recommended.latency_pool_max_num_seqs == 32 and f.recommended.throughput_pool_concurrency == 8


def test_without_an_slo_there_is_no_goodput_and_the_sweet_spot_is_the_latency_pool() -> None:
    found = findings_from_documents(sweep(fit=8))
    f = layout(found)
    assert f.max_goodput_under_slo is None and all(p.meets_slo is None for p in f.points)
    assert all("goodput_req_s" not in p.figures for p in f.points)
    assert f.recommended.latency_pool_max_num_seqs == 8 and f.recommended.throughput_pool_concurrency == 8
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


def test_an_slo_percentile_the_samples_cannot_support_is_not_judged() -> None:
    found = findings_from_documents(sweep(fit=8, requests=64), slo=SLO)
    f = layout(found)
    assert all(p.meets_slo is None and p.slo_notes for p in f.points)
    assert all(p.valid for p in f.points) and f.sweet_spot.concurrency == 8  # the curve still stands
    assert f.max_goodput_under_slo is None and f.recommended.latency_pool_max_num_seqs is None
    assert "ttft p99 of 64 requests is near their maximum" in (f.points[0].to_dict()["percentile_note"] or "")
    assert any("the data cannot say whether any point meets it" in s for s in found.sentences)


# --------------------------------------------------------------------------- invalid points and repeats


def test_an_invalid_point_is_kept_flagged_and_left_out_of_the_curve() -> None:
    docs = sweep(fit=8)
    docs[3] = document(RunSpec(concurrency=8, throughput=800, failed=5, kv_usage=0.7, labels={"kv_fit": 8}))
    found = findings_from_documents(docs, slo=SLO)
    f = layout(found)
    bad = f.point(8)
    assert not bad.valid and bad.regime is None and bad.meets_slo is None
    assert bad.invalid_reasons == ("5 of 240 requests failed (timeout 5)",)
    assert f.sweet_spot.concurrency != 8 and f.max_goodput_under_slo.concurrency != 8
    assert found.to_dict()["invalid_points"] == [
        {"engine": "alpha", "layout": "continuous", "concurrency": 8,
         "reasons": ["5 of 240 requests failed (timeout 5)"]}]
    # One sentence, however many points: counted by kind of reason, listed by engine and layout.
    assert "1 point(s) invalid, shown but left out of the findings (failed requests: 1): alpha continuous at 8." \
        in found.sentences


def test_repeats_give_the_range_and_an_invalid_repeat_is_excluded_not_dropped() -> None:
    docs = sweep(levels=(4, 8), repeats=3)
    f = layout(findings_from_documents(docs))
    four = f.point(4)
    tok = four.figure("output_tok_s")
    assert (tok.method, tok.n) == ("repeats", 3)
    assert (tok.median, tok.low, tok.high) == pytest.approx((408.0, 400.0, 416.0))
    # One repeat disturbed: the point stands on the other two, and says which run it left out.
    docs[2] = document(RunSpec(concurrency=4, repeat=1, throughput=100, foreign=0.5, labels={"kv_fit": 8}))
    f = layout(findings_from_documents(docs))
    four = f.point(4)
    assert four.valid and four.figure("output_tok_s").n == 2 and four.figure("output_tok_s").low == 400.0
    assert four.excluded_runs[0][0] == "alpha-continuous-c4-r1" and "machine's CPU" in four.excluded_runs[0][1][0]


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
    cos = layout(found).continuous_over_static
    at = cos.at[8]
    assert at.ratio == Estimate(150 / 105, 140 / 110, 160 / 100, 3, "repeats") and not at.ratio.within_noise
    assert at.mean_decoding == pytest.approx(4.8) and at.static_mean_decoding == pytest.approx(2.88)
    from batchbench.theory import continuous_idle_fraction, waves_idle_fraction
    assert at.ideal_mean_decoding == pytest.approx(8 * (1 - continuous_idle_fraction(outputs, 8)))
    assert at.ideal_static_mean_decoding == pytest.approx(8 * (1 - waves_idle_fraction(outputs, 8)))
    assert (f"alpha: continuous batching gives 1.43x [1.27–1.60] the throughput of static waves at batch 8: 4.8 "
            f"requests decoding on average vs 2.9 (ideal {at.ideal_mean_decoding:.1f} vs "
            f"{at.ideal_static_mean_decoding:.1f}).") in found.sentences


def test_overlapping_layouts_are_within_noise() -> None:
    found = findings_from_documents(layouts("alpha", [100, 110, 120], [95, 105, 115], mixed_outputs()))
    cos = layout(found).continuous_over_static
    assert cos.headline.ratio.within_noise
    assert found.to_dict()["engines"]["alpha"]["continuous"]["continuous_over_static"]["within_noise"] is True
    assert any("within noise" in s for s in found.sentences)


def test_without_static_waves_the_comparison_says_it_cannot_be_made() -> None:
    found = findings_from_documents(sweep(levels=(4, 8)))
    assert layout(found).continuous_over_static is None
    assert "alpha: continuous batching cannot be compared with static waves (no valid static-waves point)." \
        in found.sentences


def test_engines_are_compared_at_their_sweet_spots() -> None:
    docs = sweep(fit=8, repeats=2) + sweep(fit=8, repeats=2, per_slot=50.0, engine="beta")
    found = findings_from_documents(docs)
    (c,) = found.comparisons
    assert (c.metric, c.layout, c.a, c.b) == ("output_tok_s at sweet spot", "continuous", "alpha", "beta")
    assert c.ratio.median == pytest.approx(2.0) and not c.ratio.within_noise
    assert found.sentences[0].startswith("continuous: alpha gives 2.00x [")
    assert "the output tokens/s of beta at their sweet spots (alpha ahead)" in found.sentences[0]


def test_padding_cost_predicted_and_measured() -> None:
    long, short = 1024, 25
    docs = [
        document(RunSpec(layout="padded-mixed", concurrency=32, requests=32, prompts=[long] + [short] * 31, ttft=1.0,
                         wave=1, engine_report={"prompt_pad_fraction": 0.945})),
        document(RunSpec(layout="homogeneous", concurrency=32, requests=32, prompts=[short] * 32, ttft=0.1, wave=1)),
    ]
    found = findings_from_documents(docs)
    cost = layout(found, name="padded-mixed").padding_cost.at[32]
    assert cost.padded_fraction_predicted == pytest.approx(31 * (long - short) / (32 * long))
    assert cost.real_token_ratio == pytest.approx((long + 31 * short) / (32 * short))
    assert cost.padded_token_ratio == pytest.approx(32 * long / (32 * short))
    assert cost.latency_ratio.median == pytest.approx(10, rel=0.15) and cost.pays_for_padding
    assert cost.measured_pad_fraction == 0.945
    assert any("predicted to be 94.5% padding" in s and "more than its real tokens explain" in s
               for s in found.sentences)
    assert layout(found, name="padded-mixed").recommended.throughput_pool_concurrency is None


# --------------------------------------------------------------------------- the document shape and entry points

POINT_KEYS = {"concurrency", "output_tok_s", "ttft_p99_s", "ttft_p50_s", "tpot_p50_s", "goodput_req_s", "meets_slo",
              "regime", "valid", "invalid_reasons", "kv_usage_peak", "preemptions", "mean_decoding", "run_ids"}
LAYOUT_KEYS = {"points", "sweet_spot", "memory_bound_from", "max_goodput_under_slo", "continuous_over_static",
               "padding_cost", "recommended"}


def test_to_dict_has_the_shape_the_report_reads_and_is_strict_json() -> None:
    docs = sweep(fit=8) + layouts("alpha", [900, 910], [600, 610], mixed_outputs())
    found = findings_from_documents(docs, slo=SLO).to_dict()
    assert {"slo", "sentences", "engines", "comparisons", "invalid_points"} <= set(found)
    assert found["slo"] == {"ttft_p99": 0.2}
    cont = found["engines"]["alpha"]["continuous"]
    assert LAYOUT_KEYS <= set(cont) and POINT_KEYS <= set(cont["points"][0])
    assert set(cont["points"][0]["output_tok_s"]) == {"median", "low", "high", "n", "method"}
    assert set(cont["sweet_spot"]) >= {"concurrency", "output_tok_s", "ttft_p99_s", "evidence"}
    assert set(cont["memory_bound_from"]) >= {"concurrency", "regime", "kv_usage_peak", "kv_fit_predicted", "evidence"}
    assert set(cont["max_goodput_under_slo"]) >= {"concurrency", "goodput_req_s", "output_tok_s", "first_failing",
                                                  "evidence"}
    assert set(cont["continuous_over_static"]) >= {"at", "at_sweet_spot", "within_noise"}
    assert set(cont["continuous_over_static"]["at"]["8"]) >= {"ratio", "mean_decoding", "ideal_mean_decoding",
                                                              "static_mean_decoding"}
    assert cont["continuous_over_static"]["at_sweet_spot"] == cont["continuous_over_static"]["at"]["8"]["ratio"]
    assert set(cont["recommended"]) == {"latency_pool_max_num_seqs", "throughput_pool_concurrency", "why"}
    json.dumps(found, allow_nan=False)


def test_the_same_seed_gives_the_same_findings() -> None:
    docs = sweep(levels=(2, 8), jitter=1.0)
    assert findings_from_documents(docs, seed=7).to_dict() == findings_from_documents(docs, seed=7).to_dict()


def test_an_engine_under_two_batching_configs_is_two_curves() -> None:
    docs = sweep(levels=(4, 8)) + sweep(levels=(4, 8), batching={"mode": "static", "max_batch_size": 8})
    assert len(findings_from_documents(docs).engines) == 2


def test_findings_from_a_run_folder_match_the_documents_and_name_what_they_skipped(tmp_path: Path) -> None:
    docs = sweep(levels=(2, 4, 8, 16))
    for doc in docs:
        (tmp_path / f"{doc.header.run_id}.json").write_text(doc.to_json(), encoding="utf-8")
    (tmp_path / "benchmark.json").write_text('{"machine_info": {}}', encoding="utf-8")  # someone else's
    (tmp_path / "broken.json").write_text('{"schema": "batchbench.results", "schema_version": 99}', encoding="utf-8")
    odd = document(RunSpec(arrival="poisson"))
    odd.header.labels.clear()
    (tmp_path / "open-loop.json").write_text(odd.to_json(), encoding="utf-8")
    from_dir = findings_from_dir(tmp_path, slo=SLO)
    assert from_dir.engines.keys() == {"alpha"}
    expected = findings_from_documents(docs, slo=SLO).to_dict()
    got = from_dir.to_dict()
    assert got["engines"]["alpha"]["continuous"]["sweet_spot"] == expected["engines"]["alpha"]["continuous"][
        "sweet_spot"]
    assert [p["run_ids"] for p in got["engines"]["alpha"]["continuous"]["points"]] == [
        [f"alpha-continuous-c{c}-r0"] for c in (2, 4, 8, 16)]
    assert len(from_dir.skipped) == 2
    assert any(s.startswith("broken.json: skipped") for s in from_dir.skipped)
    assert any(s.startswith("open-loop.json: no layout and concurrency") for s in from_dir.skipped)
    assert str(tmp_path) not in json.dumps(got)


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
               "request w-00003: prompt 17 tokens, workload 16" in s for s in found.sentences)
    assert findings_from_documents(sweep(levels=(1, 2))).parity["alpha"].ok  # no counts reported: nothing to flag
