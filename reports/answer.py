"""The report's first screen: the decisions (:class:`batchbench.analysis.findings.Findings`), then the evidence
behind them.

A reader opens a report to learn which batch size, which batching strategy and which engine to run;
the per-run tables come after. The first section answers the questions of
:data:`batchbench.analysis.findings.QUESTIONS`, one line per engine, each linked to the evidence of the curve it
was read from; then the engines against each other and how many runs were left out, by cause, linked
to the table that lists them. Below: every topic's sentence, and per engine and layout the points with
their figures (the mean [95% interval] over n repeats) and the runs behind each finding.
"""

from __future__ import annotations

from collections.abc import Callable

from batchbench.analysis.bound_share import percent
from batchbench.analysis.findings import QUESTIONS, Findings, LayoutFindings, PointFindings
from batchbench.analysis.findings.decisions import slo_text
from batchbench.analysis.findings.invalid import by_kind
from batchbench.analysis.findings.pick import Pick
from batchbench.analysis.findings.speculation import Speculation
from batchbench.analysis.regimes import PEAK_SHARE
from batchbench.analysis.repeats import CONFIDENCE, MIN_DECIDING_REPEATS, Estimate
from batchbench.measures.guardrails import KV_DANGER
from batchbench.reports import fmt
from batchbench.reports.blocks import Block, Bullets, Cell, Para, Section, Table

Formatter = Callable[[object], str]
#: The anchor of the table of runs left out.
INVALID_ANCHOR = "invalid-runs"
#: The words of the curve, as every part of batchbench uses them (batchbench.analysis.regimes).
VOCABULARY = (f"Sweet spot: the smallest batch size whose throughput is within {1 - PEAK_SHARE:.0%} of the most "
              "measured; past it, more requests add latency, not throughput. Memory-bound: only where the KV cache "
              f"reached {KV_DANGER:.0%} or the engine preempted; a plateau without that is compute-saturated (the "
              "engine reports its cache, and it is not full) or saturated (it reports none).")


def layouts(findings: Findings) -> list[tuple[str, str, LayoutFindings]]:
    """(engine, layout, its findings) in a stable order: engines by name, layouts as the findings list them."""
    return [(engine, layout, f) for engine, e in sorted(findings.engines.items()) for layout, f in e.layouts.items()]


def anchors(findings: Findings) -> dict[tuple[str, str], str]:
    """The evidence section of each engine and layout, by position: engine names come from results files and
    are never written into an id."""
    return {(engine, layout): f"evidence-{i}" for i, (engine, layout, _) in enumerate(layouts(findings), 1)}


def interval(value: Estimate | None, unit: Formatter = fmt.number) -> str:
    """``median [low–high]``-style: ``value [low–high]``, or ``value (n=1)`` without an interval; "n/a" for none."""
    if value is None:
        return fmt.NA
    if value.low is None or value.high is None:
        return f"{unit(value.value)} (n={value.n})"
    return f"{unit(value.value)} [{unit(value.low)}–{unit(value.high)}]"


def _ratio(value: Estimate | None) -> str:
    text = interval(value)
    return fmt.NA if text == fmt.NA else f"x{text}"


def decisions_table(findings: Findings, links: dict[tuple[str, str], str]) -> Table:
    """A row per question, a column per engine: its one-line answer, linked to the curve it was read from."""
    engines = [e.decisions for _, e in sorted(findings.engines.items())]
    rows = []
    for key, question in QUESTIONS.items():
        title = f"{question} ({slo_text(findings.slo)})" if key == "latency" else question
        rows.append([Cell(title), *(Cell(d.answers(findings.slo)[key], link=links.get((d.engine, d.layout or ""), ""))
                                    for d in engines)])
    return Table(["Question", *(d.engine for d in engines)], rows,
                 caption=f"Figures: the mean [{CONFIDENCE:.0%} interval] over n repeats (Student's t on the log scale; "
                         "ratios by the delta method); each answer links to the curve it was read from. A point with "
                         f"fewer than {MIN_DECIDING_REPEATS} repeats and an interval wider than the precision asked "
                         "decides nothing (too few repeats). " + VOCABULARY, prose=True)


def standings_table(found: Pick) -> Table:
    """Every engine on its continuous curve, beside the pick: its best throughput, its best goodput within the SLO,
    and its figure against the pick's."""
    unit = "goodput" if found.metric == "max goodput under the SLO" else "throughput"
    rows = []
    for s in found.standings:
        against = "the pick" if s.engine == found.engine else fmt.NA if s.to_pick is None else \
            f"{_ratio(s.to_pick)}" + ("" if s.to_pick.differs_from_one else " (within noise)"
                                      if s.to_pick.differs_from_one is False else " (no interval)")
        rows.append([Cell(s.engine, "best" if s.engine == found.engine else ""),
                     Cell(fmt.NA if s.throughput is None else f"{interval(s.throughput, fmt.rate)} at batch "
                                                              f"{s.throughput_at}"),
                     Cell("none shown to meet it" if s.goodput is None else f"{interval(s.goodput, fmt.rate)} at batch "
                                                                   f"{s.goodput_at}"),
                     Cell(against)])
    return Table(["Engine", "Most output tok/s", "Most goodput within the SLO (req/s)", f"Its {unit} over the pick's"],
                 rows, caption="Each engine's continuous-load curve: the mean [95% interval] over its repeats; ratios "
                               "by the delta method, unpaired (the engines ran one after another)."
                               + (f" Measured {found.scope}." if found.scope else ""))


def invalid_table(findings: Findings) -> Table:
    rows = [[Cell(f"{r.engine} {r.layout} c={r.concurrency}"), Cell(r.kind, "bad"), Cell(r.run_id),
             Cell("; ".join(r.reasons))] for r in findings.invalid_runs]
    return Table(["Point", "Cause", "Run", "Why"], rows,
                 caption="Runs left out of every finding: the cause is the kind of the first reason "
                         "(batchbench.analysis.validity).")


def speculation_table(found: Speculation) -> Table:
    """One engine and layout with speculation against without, per batch size: TPOT p50 both ways, the speedup
    (without over with; at most 1 is where speculation stops paying) and the engine's own acceptance counters."""
    rows = []
    for p in found.at:
        median = p.speedup.value if p.speedup is not None else None
        rows.append([Cell(f"c={p.concurrency}" + ("" if p.valid else " (invalid, not used)"),
                          "" if p.valid else "warn"),
                     Cell(interval(p.tpot_p50_without_s, fmt.ms)), Cell(interval(p.tpot_p50_with_s, fmt.ms)),
                     Cell(_ratio(p.speedup), "bad" if median is not None and median <= 1 else ""),
                     Cell(fmt.pct(p.acceptance_rate)),
                     Cell(fmt.NA if p.tokens_per_step is None else f"{p.tokens_per_step:.2f}")])
    where = (f"it stops paying from c={found.crossover}" if found.crossover is not None
             else f"it still pays at c={found.largest_measured}, the largest valid one measured"
             if found.largest_measured is not None else "no valid batch size")
    return Table(["Batch", "TPOT p50 without (ms)", "TPOT p50 with (ms)", "Speedup", "Acceptance",
                  "Tokens per drafted step"], rows,
                 caption=f"{found.engine}, {found.layout}: {found.method} speculative decoding, {found.draft_tokens} "
                         f"draft tokens, against the same configuration without; {where}. Acceptance and tokens per "
                         "step are the engine's own counters.")


def answer_section(findings: Findings, headlines: list[Block] | None = None) -> Section:
    """The answer: the SLO, the decisions per engine, the engines against each other and the runs left out,
    then ``headlines`` (one plot per engine, given by the caller)."""
    sec = Section("The answer", anchor="answer")
    sec.blocks.append(Para(f"SLO: {slo_text(findings.slo)}." if findings.slo is not None
                           else "No SLO given: the latency question is not answered."))
    if not findings.engines:
        sec.blocks.append(Para("No finding could be drawn from these runs."))
        return sec
    lead = findings.pick.sentences() if findings.pick is not None else []
    if findings.pick is not None:
        sec.blocks.append(Para(" ".join(lead), "best" if findings.pick.engine is not None else "warn"))
        if len(findings.pick.standings) > 1:
            sec.blocks.append(standings_table(findings.pick))
    sec.blocks.append(decisions_table(findings, anchors(findings)))
    if rest := list(findings.answer[len(lead):]):
        sec.blocks.append(Bullets(rest))
    if findings.invalid_runs:
        kinds = ", ".join(f"{kind}: {n}" for kind, n in by_kind(findings.invalid_runs).items())
        sec.blocks.append(Table(["Runs left out", "By cause"], [[
            Cell(f"{len(findings.invalid_runs)} of {findings.runs}", "bad"), Cell(kinds, link=INVALID_ANCHOR)]]))
    sec.blocks += headlines or []
    return sec


def details_section(findings: Findings) -> Section:
    """Every topic's sentence, speculation's tables, and the runs left out with why."""
    sec = Section("In detail", anchor="details")
    if findings.details:
        sec.blocks.append(Bullets(list(findings.details)))
    sec.blocks += [speculation_table(sp) for sp in findings.speculation]
    if findings.invalid_runs:
        sec.blocks.append(Section("Runs left out", level=3, anchor=INVALID_ANCHOR, blocks=[invalid_table(findings)]))
    return sec


_POINT_COLUMNS: tuple[tuple[str, str, Formatter], ...] = (
    ("Output tok/s", "output_tok_s", fmt.rate),
    ("TTFT p99 (ms)", "ttft_p99_s", fmt.ms),
    ("TTFT p50 (ms)", "ttft_p50_s", fmt.ms),
    ("TPOT p50 (ms)", "tpot_p50_s", fmt.ms),
    ("Goodput (req/s)", "goodput_req_s", fmt.rate),
    ("Mean decoding", "mean_decoding", fmt.number),
    ("Tok/J", "tokens_per_joule", fmt.number),
)


def _pooled(p: PointFindings, key: str) -> Cell:
    """A pooled percentile with its own interval (batchbench.analysis.quantiles), flagged where too few requests
    bound it."""
    found = p.tails.get(key)
    if found is None:
        return Cell(fmt.NA)
    low = "?" if found.low is None else fmt.ms(found.low)
    high = "?" if found.high is None else fmt.ms(found.high)
    text = f"{fmt.ms(found.value)} [{low}–{high}], n={found.n}"
    return Cell(text if found.bounded else f"{text}: too few (needs {found.needed})",
                "" if found.bounded else "warn")


def _precision(p: PointFindings) -> Cell:
    found = p.figure("output_tok_s")
    share = found.relative_half_width if found is not None else None
    text = fmt.NA if share is None else f"±{share:.1%}"
    if p.precise is False:
        return Cell(f"{text} (target ±{p.precision_target:.0%})", "warn")
    return Cell(text)


def _of_limit(f: LayoutFindings, concurrency: int) -> Cell:
    """``41% (bandwidth)``: the point's share of the limit on paper and what binds there; flagged past 100%."""
    found = f.limit.points.get(concurrency) if f.limit is not None else None
    if found is None:
        return Cell(fmt.NA)
    return Cell(f"{percent(found.share.share)} ({found.share.bound})", "bad" if found.share.beats_bound else "")


def _regime(p: PointFindings) -> Cell:
    """The point's regime; a valid point with too few repeats to decide on has none, and says why."""
    if p.valid and p.thin:
        return Cell("too few repeats", "warn")
    return Cell(str(p.regime or fmt.NA))


def points_table(f: LayoutFindings) -> Table:
    """Each point's figures, judgements and runs; with a column of its share of the limit where there is one."""
    limit = f.limit.setup if f.limit is not None and f.limit.points else None
    rows = []
    for p in f.points:
        cells = [Cell(f"c={p.concurrency}")]
        cells += [Cell(interval(p.figure(key), unit)) for _, key, unit in _POINT_COLUMNS]
        cells.append(_pooled(p, "ttft_p99_s"))
        slo = f.slo_points.get(p.concurrency)
        cells += [
            Cell(str(len(p.run_ids))),
            _precision(p),
            Cell(fmt.NA if slo is None else slo.judgement, "" if slo is None or slo.judgement == "meets" else "warn"),
            _regime(p),
            Cell("yes" if p.valid else "no: " + "; ".join(p.invalid_reasons), "" if p.valid else "bad"),
            Cell(fmt.pct(p.kv_usage_peak)),
            Cell(fmt.count(p.preemptions)),
            *([_of_limit(f, p.concurrency)] if limit is not None else []),
            Cell(", ".join(p.run_ids)),
        ]
        rows.append(cells)
    titles = ["Point", *(title for title, _, _ in _POINT_COLUMNS), "TTFT p99 pooled (ms)", "Runs", "Throughput ±",
              "SLO", "Regime", "Valid",
              "KV peak", "Preemptions", *(["Of the limit"] if limit is not None else []), "Run ids"]
    caption = (f"Each figure: the mean [{CONFIDENCE:.0%} t-interval, on the log scale] over the point's valid runs. "
               "TTFT p99 pooled: the p99 of every counted request of the point's runs, with its distribution-free "
               f"{CONFIDENCE:.0%} interval from order statistics; '?' where the requests are too few to bound it "
               "(a p99 needs 368). SLO: a percentile objective judged on that pooled interval (too few requests: "
               "it cannot bound it on the side that would decide). Throughput ±: the interval's half-width against "
               "the precision target. Too few "
               "repeats: fewer than "
               f"{MIN_DECIDING_REPEATS} and wider than the target, so it decides nothing.")
    if limit is not None:
        caption += (" Of the limit: output tokens/s over its ceiling on paper at the point's batch size (TPOT's floor "
                    f"over TPOT p50 where no tokens/s was measured) and what binds there, for {limit.text()}; the "
                    f"arithmetic: {limit.command()}.")
    return Table(titles, rows, caption=caption)


def evidence_sections(findings: Findings) -> list[Section]:
    """One section per engine and layout: its points and which runs each finding rests on."""
    links = anchors(findings)
    out = []
    for engine, layout, f in layouts(findings):
        sec = Section(f"Evidence: {engine}, {layout}", anchor=links[(engine, layout)])
        sec.blocks.append(points_table(f) if f.points else Para("No points."))
        cited = []
        for title, found in (("Sweet spot", f.sweet_spot), ("Memory-bound from", f.memory_bound),
                             ("Most throughput", f.most_throughput), ("Max goodput under SLO", f.max_goodput)):
            if found is not None and found.evidence:
                cited.append(f"{title} (c={found.concurrency}): runs {', '.join(found.evidence)}")
        if cited:
            sec.blocks.append(Bullets(cited))
        out.append(sec)
    return out
