"""The report's first screen: the answer (``batchbench.findings``' dict), then the evidence it rests on.

A reader opens a report to learn which engine to run and how to size it; the
per-run tables come after. The findings are taken as their JSON form
(``Findings.to_dict()``, also stored in report.json under ``"findings"``), so
this module needs nothing but that dict: every field may be missing or null,
and a figure without data reads "n/a", never 0.

Each figure is an interval dict (``{"median", "low", "high", "n", "method"}``)
shown as ``median [low–high]``; each cell of an engine's table links to the
evidence section of its engine and layout, which lists the points and the runs
behind every finding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchbench.reports import fmt
from batchbench.reports.document import Bullets, Cell, Para, Section, Table

Findings = dict[str, Any]
Formatter = Callable[[object], str]


def engines(findings: Findings) -> list[tuple[str, str, dict[str, Any]]]:
    """(engine, layout, its findings) in a stable order: engines by name, layouts as the findings list them."""
    found = findings.get("engines")
    if not isinstance(found, dict):
        return []
    return [(engine, layout, data) for engine, layouts in sorted(found.items()) if isinstance(layouts, dict)
            for layout, data in layouts.items() if isinstance(data, dict)]


def anchors(findings: Findings) -> dict[tuple[str, str], str]:
    """The evidence section of each engine and layout, by position: engine names come from results files and
    are never written into an id."""
    return {(engine, layout): f"evidence-{i}" for i, (engine, layout, _) in enumerate(engines(findings), 1)}


def interval(value: Any, unit: Formatter = fmt.number) -> str:
    """``median [low–high]`` (just the median when the interval is one point); "n/a" without a median."""
    if not isinstance(value, dict) or fmt.num(value.get("median")) is None:
        return fmt.NA
    median, low, high = (fmt.num(value.get(k)) for k in ("median", "low", "high"))
    if low is None or high is None or low == high:
        return unit(median)
    return f"{unit(median)} [{unit(low)}–{unit(high)}]"


def _ratio(value: Any) -> str:
    text = interval(value, lambda v: fmt.number(v) if fmt.num(v) is not None else fmt.NA)
    return fmt.NA if text == fmt.NA else f"x{text}"


def _c(point: dict[str, Any]) -> str:
    return f"c={point.get('concurrency')}"


def sweet_spot_text(found: Any) -> str:
    if not isinstance(found, dict):
        return "none found"
    return (f"{_c(found)}: {interval(found.get('output_tok_s'), fmt.rate)} tok/s, "
            f"TTFT p99 {interval(found.get('ttft_p99_s'), fmt.ms)} ms")


def memory_bound_text(found: Any) -> str:
    if not isinstance(found, dict):
        return "not reached"
    parts = [f"{_c(found)} ({found.get('regime') or 'memory-bound'})"]
    if fmt.num(found.get("kv_usage_peak")) is not None:
        parts.append(f"KV peak {fmt.pct(found.get('kv_usage_peak'))}")
    if found.get("kv_fit_predicted") is not None:
        parts.append(f"predicted to fit {found.get('kv_fit_predicted')} sequences")
    return ", ".join(parts)


def kv_plan_text(engine: str, layout: str, found: Any) -> str | None:
    """The planner's arithmetic behind a memory-bound finding, in one sentence (None: the finding has none)."""
    plan = found.get("kv_plan") if isinstance(found, dict) else None
    if not isinstance(plan, dict):
        return None
    return (f"{engine}, {layout}: {fmt.count(plan.get('kv_capacity_tokens'))} tokens of KV cache at "
            f"{fmt.count(plan.get('kv_bytes_per_token'))} B per token ({fmt.count(plan.get('kv_memory_bytes'))} B, "
            f"blocks of {plan.get('block_size')}); a sequence of the workload takes {plan.get('sequence_tokens')} "
            f"tokens, so {plan.get('fit')} fit at once and the cache fills from batch {plan.get('memory_bound_from')}; "
            f"measured memory-bound from {_c(found)}.")


def goodput_text(found: Any, slo: Any) -> str:
    if not slo:
        return "no SLO given"
    if not isinstance(found, dict):
        return "no point meets the SLO"
    text = (f"{_c(found)}: {interval(found.get('goodput_req_s'), fmt.rate)} req/s "
            f"({interval(found.get('output_tok_s'), fmt.rate)} tok/s)")
    failing = found.get("first_failing")
    if isinstance(failing, dict):
        text += f"; fails from {_c(failing)}: {', '.join(map(str, failing.get('failed') or []))}"
    return text


def continuous_text(found: Any) -> str:
    if not isinstance(found, dict):
        return "—"
    noise = " (within noise)" if found.get("within_noise") else ""
    if isinstance(found.get("at_sweet_spot"), dict):
        return f"{_ratio(found['at_sweet_spot'])} at the sweet spot{noise}"
    at = found.get("at") if isinstance(found.get("at"), dict) else {}
    parts = [f"c={c}: {_ratio(v.get('ratio'))}" for c, v in at.items() if isinstance(v, dict)]
    return ("; ".join(parts) or fmt.NA) + noise


def padding_text(found: Any) -> str:
    if not isinstance(found, dict):
        return "—"
    return (f"pad {fmt.pct(found.get('padded_fraction_predicted'))} (predicted), "
            f"latency {_ratio(found.get('latency_ratio'))}")


def recommended_text(found: Any) -> str:
    if not isinstance(found, dict):
        return "—"
    parts = []
    if found.get("latency_pool_max_num_seqs") is not None:
        parts.append(f"latency pool max_num_seqs {found['latency_pool_max_num_seqs']}")
    if found.get("throughput_pool_concurrency") is not None:
        parts.append(f"throughput pool concurrency {found['throughput_pool_concurrency']}")
    if not parts:  # the reason already says there is none
        return str(found.get("why") or "no recommendation")
    return "; ".join(parts) + (f": {found['why']}" if found.get("why") else "")


#: Layouts that are a padding comparison at one batch size, not a curve: only their padding cost is a finding.
PADDING_LAYOUTS = ("padded-mixed", "homogeneous")


def engine_table(findings: Findings, engine: str, links: dict[tuple[str, str], str]) -> Table:
    """One engine's answer: a row per finding, a column per curve layout, each cell linked to its evidence;
    the padding cost in a row of its own, from the padding pair."""
    mine = [(layout, data) for e, layout, data in engines(findings) if e == engine]
    layouts = [(layout, data) for layout, data in mine if layout not in PADDING_LAYOUTS]
    padding = [(layout, data) for layout, data in mine if isinstance(data.get("padding_cost"), dict)]
    slo = findings.get("slo")
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("Sweet spot", lambda d: sweet_spot_text(d.get("sweet_spot"))),
        ("Memory-bound from", lambda d: memory_bound_text(d.get("memory_bound_from"))),
        ("Max goodput under SLO", lambda d: goodput_text(d.get("max_goodput_under_slo"), slo)),
        ("Continuous vs static", lambda d: continuous_text(d.get("continuous_over_static"))),
        ("Recommended", lambda d: recommended_text(d.get("recommended"))),
    ]
    table = [[Cell(name)] + [Cell(text(data), link=links[(engine, layout)]) for layout, data in layouts]
             for name, text in rows]
    if layouts:
        for layout, data in padding or [(None, {})]:
            cell = Cell(padding_text(data.get("padding_cost")), link=links.get((engine, layout), "") if layout else "")
            table.append([Cell("Padding cost")] + [cell] + [Cell("")] * (len(layouts) - 1))
    return Table(["Finding", *(layout for layout, _ in layouts)], table,
                 caption="median [low–high] over repeats (or a bootstrap interval); each cell links to its evidence. "
                         "Padding cost: one long prompt among short ones against all short, one wave at the "
                         "engine's batch size.")


def invalid_text(item: dict[str, Any]) -> str:
    reasons = "; ".join(map(str, item.get("reasons") or [])) or "no reason given"
    return f"{item.get('engine')} {item.get('layout')} c={item.get('concurrency')}: {reasons}"


def speculation_table(found: dict[str, Any]) -> Table:
    """One engine and layout with speculation against without, per batch size: TPOT p50 both ways, the speedup
    (without over with; at most 1 is where speculation stops paying) and the engine's own acceptance counters."""
    rows = []
    for p in found.get("points") or []:
        if not isinstance(p, dict):
            continue
        gain = p.get("speedup")
        median = fmt.num(gain.get("median")) if isinstance(gain, dict) else None
        rate, per_step = fmt.num(p.get("acceptance_rate")), fmt.num(p.get("tokens_per_step"))
        invalid = p.get("valid") is False
        rows.append([Cell(_c(p) + (" (invalid, not used)" if invalid else ""), "warn" if invalid else ""),
                     Cell(interval(p.get("tpot_p50_without_s"), fmt.ms)),
                     Cell(interval(p.get("tpot_p50_with_s"), fmt.ms)),
                     Cell(_ratio(gain), "bad" if median is not None and median <= 1 else ""),
                     Cell(fmt.pct(rate)),
                     Cell(fmt.NA if per_step is None else f"{per_step:.2f}")])
    cross = found.get("crossover")
    largest = found.get("largest_measured")
    where = (f"it stops paying from c={cross}" if cross is not None
             else f"it still pays at c={largest}, the largest valid one measured" if largest is not None
             else "no valid batch size")
    return Table(["Batch", "TPOT p50 without (ms)", "TPOT p50 with (ms)", "Speedup", "Acceptance",
                  "Tokens per drafted step"], rows,
                 caption=f"{found.get('engine')}, {found.get('layout')}: {found.get('method')} speculative decoding, "
                         f"{found.get('draft_tokens')} draft tokens, against the same configuration without; "
                         f"{where}. Acceptance and tokens per step are the engine's own counters.")


def answer_section(findings: Findings) -> Section:
    """The answer: sentences, one table per engine, the comparisons, and every point not trusted, with why."""
    sec = Section("The answer", anchor="answer")
    slo = findings.get("slo")
    if isinstance(slo, dict) and slo:
        sec.blocks.append(Para("SLO: " + ", ".join(f"{k} ≤ {fmt.ms(v)} ms" for k, v in slo.items())))
    sentences = [str(s) for s in findings.get("sentences") or []]
    sec.blocks.append(Bullets(sentences) if sentences else Para("No finding could be drawn from these runs."))
    links = anchors(findings)
    for engine in dict.fromkeys(e for e, _, _ in engines(findings)):
        sec.blocks.append(Section(f"{engine}", level=3, blocks=[engine_table(findings, engine, links)]))
    comparisons = [c for c in findings.get("comparisons") or [] if isinstance(c, dict)]
    if comparisons:
        sec.blocks.append(Table(["Metric", "A", "B", "A / B", "Within noise"], [
            [Cell(str(c.get("metric"))), Cell(str(c.get("a"))), Cell(str(c.get("b"))), Cell(_ratio(c.get("ratio"))),
             Cell("yes" if c.get("within_noise") else "no")] for c in comparisons],
            caption="Engines against each other: the ratio of A's figure to B's, median [low–high]."))
    for found in findings.get("speculation") or []:
        if isinstance(found, dict):
            sec.blocks.append(speculation_table(found))
    invalid = [i for i in findings.get("invalid_points") or [] if isinstance(i, dict)]
    if invalid:
        sec.blocks.append(Para(f"{len(invalid)} point{'s' if len(invalid) != 1 else ''} not used for any finding:",
                               "bad"))
        sec.blocks.append(Bullets([invalid_text(i) for i in invalid], "bad"))
    return sec


_POINT_COLUMNS: tuple[tuple[str, str, Formatter], ...] = (
    ("Output tok/s", "output_tok_s", fmt.rate),
    ("TTFT p99 (ms)", "ttft_p99_s", fmt.ms),
    ("TTFT p50 (ms)", "ttft_p50_s", fmt.ms),
    ("TPOT p50 (ms)", "tpot_p50_s", fmt.ms),
    ("Goodput (req/s)", "goodput_req_s", fmt.rate),
    ("Mean decoding", "mean_decoding", fmt.number),
)


def _yes_no(value: Any) -> str:
    return fmt.NA if value is None else ("yes" if value else "no")


def points_table(points: list[dict[str, Any]]) -> Table:
    rows = []
    for p in points:
        cells = [Cell(_c(p))]
        cells += [Cell(interval(p.get(key), unit)) for _, key, unit in _POINT_COLUMNS]
        valid = p.get("valid", True)
        cells += [
            Cell(_yes_no(p.get("meets_slo"))),
            Cell(str(p.get("regime") or fmt.NA)),
            Cell("yes" if valid else "no: " + "; ".join(map(str, p.get("invalid_reasons") or [])),
                 "" if valid else "bad"),
            Cell(fmt.pct(p.get("kv_usage_peak"))),
            Cell(fmt.count(p.get("preemptions"))),
            Cell(", ".join(map(str, p.get("run_ids") or []))),
        ]
        rows.append(cells)
    return Table(["Point", *(title for title, _, _ in _POINT_COLUMNS), "Meets SLO", "Regime", "Valid", "KV peak",
                  "Preemptions", "Runs"], rows)


def evidence_sections(findings: Findings) -> list[Section]:
    """One section per engine and layout: its points and which runs each finding rests on."""
    links = anchors(findings)
    out = []
    for engine, layout, data in engines(findings):
        sec = Section(f"Evidence: {engine}, {layout}", anchor=links[(engine, layout)])
        points = [p for p in data.get("points") or [] if isinstance(p, dict)]
        sec.blocks.append(points_table(points) if points else Para("No points."))
        cited = []
        for key, title in (("sweet_spot", "Sweet spot"), ("memory_bound_from", "Memory-bound from"),
                           ("max_goodput_under_slo", "Max goodput under SLO")):
            found = data.get(key)
            if isinstance(found, dict) and found.get("evidence"):
                cited.append(f"{title} ({_c(found)}): runs {', '.join(map(str, found['evidence']))}")
        why = (data.get("recommended") or {}).get("why") if isinstance(data.get("recommended"), dict) else None
        if why:
            cited.append(f"Recommended because {why}")
        if cited:
            sec.blocks.append(Bullets(cited))
        out.append(sec)
    return out
