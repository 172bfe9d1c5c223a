"""Speculative decoding as a batching option: parsing, each engine's mapping or refusal by name, the engine's
counters, the arithmetic of acceptance and crossover, and the finding the report shows."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchbench.adapters.hf_static import HFStaticEngine
from batchbench.adapters.prometheus import Samples
from batchbench.adapters.registry import engine_class
from batchbench.adapters.router import _merge_capabilities
from batchbench.adapters.sglang import SGLangEngine
from batchbench.adapters.tgi import TGIEngine
from batchbench.adapters.trtllm import TRTLLMEngine
from batchbench.adapters.vllm import VLLMEngine
from batchbench.analysis.findings import findings_from_documents
from batchbench.cli import main
from batchbench.core.config import DEFAULT_SPECULATIVE_TOKENS, BatchingConfig, ModelRef
from batchbench.core.exits import EXIT_USAGE
from batchbench.core.server_metrics import ServerMetrics
from batchbench.measures.machine_load import MachineLoad
from batchbench.measures.speculation import SpeculationCounters, crossover, speedup
from batchbench.reports import markdown
from batchbench.reports.answer import details_section
from batchbench.reports.blocks import Document
from batchbench.results.document import RunDocument
from tests.synthetic_runs import RunSpec, document

MODEL = ModelRef("org/model")
NGRAM = BatchingConfig(speculative_method="ngram", speculative_tokens=3)

#: vLLM 0.32's speculation counters (v1/spec_decode/metrics.py, SpecDecodingProm) as prometheus_client renders
#: them on /metrics, with the per-position family that shares their prefix (it must not be summed in).
VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 52.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="tiny"} 1.7e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 208.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 156.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"} 52.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"} 52.0
"""


def test_the_batching_spec_parses_speculation_strictly() -> None:
    config = BatchingConfig.parse("speculative_method=ngram,speculative_tokens=3")
    assert config == NGRAM and config.draft_tokens == 3 and config.label() == "continuous-specngram3"
    assert BatchingConfig(speculative_method="ngram").draft_tokens == DEFAULT_SPECULATIVE_TOKENS
    assert BatchingConfig().draft_tokens is None
    with pytest.raises(ValueError, match="speculative_method='eagle': expected one of ngram"):
        BatchingConfig.parse("speculative_method=eagle")
    with pytest.raises(ValueError, match=r"speculative_tokens .* needs speculative_method"):
        BatchingConfig.parse("speculative_tokens=4")
    with pytest.raises(ValueError, match="speculative_tokens must be a positive integer"):
        BatchingConfig(speculative_method="ngram", speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative_method must be one of ngram"):
        BatchingConfig(speculative_method="medusa")  # type: ignore[arg-type]


def test_each_engine_maps_ngram_speculation_onto_its_own_flags() -> None:
    vllm = VLLMEngine(NGRAM, model=MODEL, url="http://v.test").server_args(NGRAM, host="h", port=1)
    spec = vllm[vllm.index("--speculative-config") + 1]
    assert json.loads(spec) == {"method": "ngram", "num_speculative_tokens": 3}
    assert "--speculative-config" not in VLLMEngine(model=MODEL, url="http://v.test").server_args(
        BatchingConfig(), host="h", port=1)
    sglang = SGLangEngine(NGRAM, model=MODEL, url="http://s.test").server_args(NGRAM, host="h", port=1)
    assert sglang[-4:] == ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"]
    tgi = TGIEngine(NGRAM, model=MODEL, url="http://t.test").server_args(NGRAM, host="h", port=1)
    assert tgi[-2:] == ["--speculate", "3"]


@pytest.mark.parametrize("name", ["hf-static", "trtllm"])
def test_an_engine_without_the_method_refuses_it_by_name(name: str) -> None:
    with pytest.raises(ValueError, match=rf"engine '{name}' has no speculative decoding by "
                                         r"speculative_method='ngram' \(it has: none\)"):
        engine_class(name).check_config(NGRAM if name != "hf-static" else BatchingConfig(
            mode="static", speculative_method="ngram"))


def test_refusals_come_before_an_engine_starts() -> None:
    with pytest.raises(ValueError, match="speculative_method"):
        HFStaticEngine(BatchingConfig(mode="static", speculative_method="ngram"))
    with pytest.raises(ValueError, match="speculative_method"):
        TRTLLMEngine(NGRAM, model=MODEL, url="http://trtllm.test")


@pytest.mark.parametrize(("spec", "message"), [
    ("speculative_method=eagle", "speculative_method='eagle'"),
    ("mode=static,speculative_method=ngram", "engine 'hf-static' has no speculative decoding"),
])
def test_the_cli_refuses_a_method_with_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     spec: str, message: str) -> None:
    argv = ["bench", "--engine", "hf-static", "--batching", spec, "--input-len", "4", "--output-len", "4",
            "--num-requests", "2", "--results-dir", str(tmp_path), "--no-report"]
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    assert code == EXIT_USAGE and message in captured.err, captured.err
    assert not any(tmp_path.iterdir()), "a usage error must be found before anything is written or started"


def test_vllm_speculation_counters_normalize_without_the_per_position_family() -> None:
    eng = VLLMEngine(NGRAM, model=MODEL, url="http://v.test")
    found = eng.normalize(Samples.parse(VLLM_METRICS, eng.metric_prefixes))
    assert (found.spec_drafts, found.spec_draft_tokens, found.spec_accepted_tokens) == (52.0, 208.0, 156.0)
    assert eng.normalize(Samples.parse("", eng.metric_prefixes)).spec_drafts is None


def test_a_router_speculates_only_by_methods_every_pool_has() -> None:
    vllm, tgi, hf = (VLLMEngine(model=MODEL, url="http://v.test"), TGIEngine(model=MODEL, url="http://t.test"),
                     HFStaticEngine(BatchingConfig(mode="static")))
    assert _merge_capabilities([vllm, tgi]).speculation_methods == {"ngram"}
    assert _merge_capabilities([vllm, hf]).speculation_methods == frozenset()


def _sample(t: float, drafts: float, draft_tokens: float, accepted: float) -> ServerMetrics:
    return ServerMetrics(t=t, spec_drafts=drafts, spec_draft_tokens=draft_tokens, spec_accepted_tokens=accepted)


@given(st.integers(0, 10_000), st.integers(1, 500), st.integers(1, 8), st.data())
def test_counters_over_a_run_give_acceptance_and_tokens_per_step(base: int, drafts: int, k: int,
                                                                  data: st.DataObject) -> None:
    accepted = data.draw(st.integers(0, drafts * k))
    samples = [ServerMetrics(t=0.0), _sample(1.0, base, base * k, base // 2),
               _sample(2.0, base + drafts, (base + drafts) * k, base // 2 + accepted)]
    c = SpeculationCounters.over(samples)
    assert c is not None and c.drafts == drafts and c.draft_tokens == drafts * k
    assert c.acceptance_rate == pytest.approx(accepted / (drafts * k)) and 0 <= c.acceptance_rate <= 1
    assert 1 <= c.tokens_per_step <= 1 + k  # type: ignore[operator]
    assert c.tokens_per_step == pytest.approx(1 + k * c.acceptance_rate)  # type: ignore[operator]


def test_no_counters_or_no_drafts_say_nothing() -> None:
    assert SpeculationCounters.over([ServerMetrics(t=0.0), ServerMetrics(t=1.0)]) is None
    idle = SpeculationCounters.over([_sample(0, 5, 20, 10), _sample(1, 5, 20, 10)])
    assert idle is not None and idle.acceptance_rate is None and idle.tokens_per_step is None


@given(st.dictionaries(st.integers(1, 512), st.floats(0.05, 20), min_size=1))
def test_the_crossover_is_the_first_batch_where_speculation_stops_paying(speedups: dict[int, float]) -> None:
    found = crossover(speedups)
    if found is None:
        assert all(v > 1 for v in speedups.values())
    else:
        assert speedups[found] <= 1 and all(v > 1 for b, v in speedups.items() if b < found)


def test_speedup_is_tpot_without_over_with() -> None:
    assert speedup(2.0, 1.0) == 2.0 and crossover({1: 2.0, 8: 1.2, 32: 0.9, 64: 1.1}) == 32
    with pytest.raises(ValueError, match="positive"):
        speedup(0.0, 1.0)


SPEC_BATCHING = {"mode": "continuous", "speculative_method": "ngram", "speculative_tokens": 4}


def _run(batch: int, tpot_s: float, spec: bool, repeat: int) -> RunDocument:
    """A synthetic run whose TPOT is ``tpot_s``; with speculation its samples carry the engine's counters
    (40 drafts of 4 tokens, 120 accepted: 75% acceptance, 4 tokens per drafted step)."""
    run = RunSpec(engine="alpha", concurrency=batch, repeat=repeat, requests=40, tokens=10, throughput=100.0,
                  decoding=tpot_s * 9 / 4.0, batching=SPEC_BATCHING if spec else {"mode": "continuous"},
                  labels={"suite": "speculative_decoding"})
    doc = document(run)
    if spec:
        doc.server_metrics = [dataclasses.replace(s, spec_drafts=40.0 * i, spec_draft_tokens=160.0 * i,
                                                  spec_accepted_tokens=120.0 * i)
                              for i, s in enumerate(doc.server_metrics)]
    return doc


def test_the_finding_pairs_runs_with_and_without_and_names_the_crossover() -> None:
    tpots = {1: (2e-3, 1e-3), 4: (3e-3, 2e-3), 16: (4e-3, 5e-3), 32: (5e-3, 4e-3)}  # without, with
    docs = [_run(b, tpot, spec, r) for b, pair in tpots.items() for spec, tpot in zip((False, True), pair)
            for r in (0, 1)]
    found = findings_from_documents(docs, suite="speculative_decoding")
    (sp,) = found.speculation
    assert (sp.engine, sp.layout, sp.method, sp.draft_tokens) == ("alpha", "continuous", "ngram", 4)
    assert [a.concurrency for a in sp.at] == [1, 4, 16, 32] and sp.crossover == 16  # the first, not the last
    assert sp.at[0].speedup is not None and sp.at[0].speedup.value == pytest.approx(2.0, rel=0.05)
    assert sp.at[0].acceptance_rate == pytest.approx(0.75) and sp.at[0].tokens_per_step == pytest.approx(4.0)
    assert any("stops paying from batch 16" in s for s in found.details), found.details
    table = markdown.render(Document("r", [details_section(found)]))
    assert "stops paying from c=16" in table and "75.0%" in table and "x2" in table


def test_without_a_partner_curve_there_is_no_speculation_finding() -> None:
    docs = [_run(b, 1e-3, True, 0) for b in (1, 4)]
    assert findings_from_documents(docs, suite="speculative_decoding").speculation == ()


def test_an_invalid_pair_is_shown_but_never_decides_the_crossover() -> None:
    docs = [_run(b, tpot, spec, 0) for b, pair in {1: (2e-3, 1e-3), 4: (1e-3, 2e-3)}.items()
            for spec, tpot in zip((False, True), pair)]
    busy = [dataclasses.replace(d, footer=dataclasses.replace(d.footer, machine=MachineLoad(0.9)))  # type: ignore[arg-type]
            if d.header.labels.concurrency == 4 else d for d in docs]
    found = findings_from_documents(busy, suite="speculative_decoding")
    (sp,) = found.speculation
    assert [a.valid for a in sp.at] == [True, False] and sp.crossover is None
    assert any("batch 4 left out" in s and "still pays at batch 1" in s for s in found.details), found.details
