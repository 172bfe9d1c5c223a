"""The answer across engines (batchbench.analysis.findings.pick): the pick for the SLO, the runner-up against it or
within noise, every engine's standing, the scope said once; from synthetic sweeps of known figures."""

from __future__ import annotations

import dataclasses

import pytest

from batchbench.analysis.findings import findings_from_documents
from batchbench.measures.slo import Slo
from tests.synthetic_runs import sweep


def test_the_engine_with_the_most_goodput_within_the_slo_is_picked_and_the_runner_up_follows() -> None:
    docs = sweep(fit=8, repeats=3) + sweep(fit=8, repeats=3, per_slot=50.0, engine="beta")
    found = findings_from_documents(docs, slo=Slo.parse("ttft_p99=10s"))
    pick = found.pick
    assert pick is not None and (pick.engine, pick.runner_up, pick.verdict) == ("alpha", "beta", "ahead")
    assert pick.metric == "max goodput under the SLO" and pick.ratio is not None and pick.ratio.value > 1
    assert pick.figure == found.engines["alpha"].layouts["continuous"].max_goodput.goodput_req_s
    assert found.answer[0].startswith(f"Pick: alpha at batch {pick.batch_size}, the most goodput within the SLO: ")
    assert found.answer[1].startswith(f"Runner-up: beta at batch {pick.runner_up_batch_size}; alpha gives x")
    # The scope once, after the pick, and no pairwise sentence in the answer.
    assert found.answer[2] == ("Every engine ranking here was measured on a CPU: framework overhead decides this, it "
                               "does not carry over to a GPU or a real model.")
    assert not any(s.startswith("Under continuous load") for s in found.answer)
    rows = {s.engine: s for s in pick.standings}
    assert rows["alpha"].to_pick is None and rows["beta"].to_pick is not None
    assert rows["beta"].to_pick.value == pytest.approx(1 / pick.ratio.value)
    as_json = found.to_dict()["pick"]
    assert (as_json["engine"], as_json["runner_up"], as_json["verdict"]) == ("alpha", "beta", "ahead")
    assert as_json["figure"]["low"] <= as_json["figure"]["value"] <= as_json["figure"]["high"]


def test_two_engines_not_told_apart_are_undecided_at_the_precision_asked_with_what_would_decide() -> None:
    docs = sweep(fit=8, repeats=3) + sweep(fit=8, repeats=3, engine="beta", per_slot=101.0)
    found = findings_from_documents(docs)
    assert found.pick is not None and found.pick.verdict == "undecided"
    assert found.pick.metric == "most throughput"  # no SLO given: ranked by throughput, and said
    assert "(no SLO given)" in found.answer[0]
    assert "the pick against it is undecided: x" in found.answer[1] and "--repeats" in found.answer[1]
    assert found.to_dict()["pick"]["verdict"] == "undecided"


def test_two_engines_within_the_precision_asked_are_within_noise() -> None:
    docs = sweep(fit=8, repeats=3) + sweep(fit=8, repeats=3, engine="beta", per_slot=101.0)
    found = findings_from_documents(docs)
    assert found.pick is not None and found.pick.ratio is not None
    loose = dataclasses.replace(found.pick, verdict="within noise", precision=0.5)
    assert "within noise of the pick" in loose.sentences()[1] and "±50% asked" in loose.sentences()[1]


def test_no_engine_within_the_slo_is_no_pick_and_says_why() -> None:
    docs = sweep(fit=8, repeats=3) + sweep(fit=8, repeats=3, per_slot=50.0, engine="beta")
    found = findings_from_documents(docs, slo=Slo.parse("ttft_p99=1us"))
    assert found.pick is not None and found.pick.engine is None
    assert found.answer[0].startswith("No pick: no engine meets the SLO at any batch size measured")
    assert found.to_dict()["pick"]["engine"] is None


def test_no_engine_shown_within_the_slo_says_the_verdicts_are_undecided_not_missed() -> None:
    """Runs of 64 requests: every batch that could meet the SLO has too few requests to bound its p99, so no engine
    is shown to meet it; the answer does not say that none meets it."""
    docs = sweep(fit=8, repeats=3, requests=64) + sweep(fit=8, repeats=3, requests=64, engine="beta")
    found = findings_from_documents(docs, slo=Slo.parse("ttft_p99=200ms"))
    assert found.pick is not None and found.pick.engine is None
    assert found.answer[0].startswith("No pick: no engine is shown to meet the SLO at any batch size measured: "
                                      "those that could had too few requests or repeats to decide")


def test_one_engine_is_the_pick_alone() -> None:
    found = findings_from_documents(sweep(fit=8, repeats=3))
    assert found.pick is not None and (found.pick.engine, found.pick.verdict) == ("alpha", "alone")
    assert found.answer[0].startswith("Pick: alpha at batch ")
