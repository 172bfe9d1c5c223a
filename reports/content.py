"""What the report says: the runs, grouped by workload, turned into sections and tables.

Engines are compared side by side only on the same workload (same name and
hash): a different hash means different prompts, lengths or arrivals, and
figures from different work do not compare. Flags (partial runs, the KV
danger zone, regressions) are written into the cell text itself, not only
as styling, so the Markdown shows them as plainly as the HTML.
"""

from __future__ import annotations

import shlex
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchbench.analysis.agreement import agreements
from batchbench.analysis.findings import Findings
from batchbench.core import codec
from batchbench.core.greedy import N_TOKENS, PROMPTS, GreedyOutputs
from batchbench.measures.guardrails import KV_DANGER
from batchbench.measures.metrics import ttft_by_bucket
from batchbench.reports import answer, answer_plots, fmt, plots
from batchbench.reports.blocks import Block, Bullets, Cell, Details, Document, Para, Plot, Section, Style, Table
from batchbench.reports.compare import BaselineComparison, best_by_metric
from batchbench.reports.inputs import Inputs
from batchbench.reports.model import (
    BUCKET_EDGES,
    KEY_METRICS,
    METRICS_BY_KEY,
    MetricSpec,
    ReportedRun,
    canonical,
    display_name,
)
from batchbench.reports.series import group_series, series_labels
from batchbench.results.claims import OUTCOMES, Claim
from batchbench.results.document import Placement

_UNIT_FORMAT: dict[str, Callable[[object], str]] = {"ms": fmt.ms, "rate": fmt.rate, "fraction": fmt.pct}


def format_metric(spec: MetricSpec, value: object) -> str:
    return _UNIT_FORMAT[spec.unit](value)


def status_text(run: ReportedRun) -> str:
    """The status cell: a partial or interrupted run is impossible to miss."""
    if run.status == "complete":
        return "complete"
    derived = " (summary from journal)" if run.summary_source == "derived" else ""
    missing = " (no figures)" if run.summary_source == "none" else ""
    return f"⚠ {run.status.upper()}{derived}{missing}"


def _danger_lines(runs: list[ReportedRun]) -> list[str]:
    """One line per series (a measurement's repeats) whose runs entered the KV danger zone: how many of them did,
    their highest peak and how many of their samples were in it. A main-job sweep's points at and past the fit
    are left to :func:`_designed_danger` (the sweep drives them there on purpose)."""
    return _danger_series([r for r in runs if not r.fills_by_design])


def _designed_danger(runs: list[ReportedRun]) -> str | None:
    """The main job's points at and past the KV fit that entered the danger zone, as the design meant them to: one
    neutral sentence, by engine and batch size (None: none did)."""
    filled: dict[str, set[int]] = defaultdict(set)
    peak = 0.0
    for r in runs:
        if r.fills_by_design and r.server.danger_zone and r.run_labels.concurrency is not None:
            filled[r.engine].add(r.run_labels.concurrency)
            peak = max(peak, r.server.kv_usage_peak or 0.0)
    if not filled:
        return None
    where = "; ".join(f"{engine} at batch {', '.join(map(str, sorted(cs)))}" for engine, cs in sorted(filled.items()))
    return (f"As designed, the sweep filled the KV cache at and past its fit ({where}; peak {fmt.pct(peak)}): the "
            "evidence of the memory-bound onset the answer reads, not an alarm.")


def _danger_series(runs: list[ReportedRun]) -> list[str]:
    found = []
    for series in group_series([r.to_row() for r in runs]):
        members = [r for r in runs if r.run_id in {str(row["run_id"]) for row in series.rows}]
        danger = [r for r in members if r.server.danger_zone]
        if not danger:
            continue
        first = danger[0]
        peak = max(r.server.kv_usage_peak or 0.0 for r in danger)
        samples = sum(r.server.kv_danger_samples for r in danger), sum(r.server.kv_samples for r in danger)
        runs_text = f"{len(danger)} of {len(members)} runs" if len(members) > 1 else "its run"
        found.append(f"⚠ {display_name(first.engine, first.batching_label, series_labels(first.to_row()))} "
                     f"({first.workload_name}) entered the KV danger zone in {runs_text}: peak KV usage "
                     f"{fmt.pct(peak)} ≥ {fmt.pct(KV_DANGER)} in {samples[0]} of {samples[1]} samples")
    return found


def _partial_text(run: ReportedRun) -> str:
    why = {
        "partial": "journal of a killed run, no footer; figures cover only the requests it recorded",
        "interrupted": f"the run was interrupted ({run.error or 'no reason recorded'}); figures cover what completed",
    }.get(run.status, f"status {run.status!r}")
    return f"⚠ {run.status.upper()}: {run.display_name()} ({run.workload_name}), {run.source}: {why}"


def _workload_order(item: tuple[tuple[str, str], list[ReportedRun]]) -> tuple[str, str, float, str]:
    """Workloads by name, then arrival kind, then load (concurrency or rate), so a sweep reads in order."""
    (name, digest), members = item
    spec = members[0].workload.spec
    if spec is None:
        return (name, "", 0.0, digest)
    arrival = spec.arrival
    load = arrival.concurrency if arrival.kind in ("closed", "waves") else arrival.rate
    return (name, arrival.kind, fmt.num(load) or 0.0, digest)


def group_by_workload(runs: list[ReportedRun]) -> list[tuple[tuple[str, str], list[ReportedRun]]]:
    """Runs grouped by workload (name and hash), each group ordered by engine and configuration."""
    groups: dict[tuple[str, str], list[ReportedRun]] = defaultdict(list)
    for r in runs:
        groups[r.workload_key].append(r)
    for members in groups.values():
        members.sort(key=lambda r: (r.engine, r.batching_label, r.labels_text(), r.started_at or "", r.run_id))
    return sorted(groups.items(), key=_workload_order)


def _column_names(runs: list[ReportedRun]) -> list[str]:
    names = [r.display_name() for r in runs]
    return [f"{n} ({r.run_id[-6:]})" if names.count(n) > 1 else n for n, r in zip(names, runs)]


def arrival_text(run: ReportedRun) -> str:
    """How the workload released its requests ("closed, concurrency 8"), or "" when not recorded."""
    spec = run.workload.spec
    if spec is None:
        return ""
    arrival = spec.arrival
    if arrival.kind in ("closed", "waves"):
        return f"{arrival.kind}, concurrency {arrival.concurrency}"
    if arrival.kind in ("poisson", "gamma"):
        return f"{arrival.kind} at {arrival.rate} req/s"
    return arrival.kind


def workload_title(name: str, digest: str, run: ReportedRun) -> str:
    """Name, arrival and short hash: one name often covers several arrivals (a concurrency sweep)."""
    arrival = arrival_text(run)
    return f"{name}" + (f", {arrival}" if arrival else "") + f" ({digest[:12] or 'no hash'})"


def _workload_intro(name: str, digest: str, runs: list[ReportedRun]) -> str:
    wl = runs[0].workload
    parts = [f"Workload {name}, hash {digest or 'n/a'}"]
    if wl.num_requests is not None:
        parts.append(f"{wl.num_requests} requests")
    if arrival := arrival_text(runs[0]):
        parts.append(f"arrivals: {arrival}")
    for counts, label in ((wl.prompt_tokens, "prompt"), (wl.output_tokens, "output")):
        if counts is not None:
            parts.append(f"{label} tokens {counts.min}..{counts.max}")
    return "; ".join(parts) + "."


def metrics_table(runs: list[ReportedRun]) -> Table:
    """Engines side by side on one workload: a column per run, a row per figure."""
    rows: list[list[Cell]] = []
    cols = _column_names(runs)
    rows.append([Cell("Status")] + [Cell(status_text(r), "" if not r.partial else "warn") for r in runs])

    def counts(r: ReportedRun) -> str:
        ok, failed = (r.summary.ok, r.summary.failed) if r.summary is not None else (None, None)
        return f"{fmt.count(ok)} / {fmt.count(failed)}"

    rows.append([Cell("Requests ok / failed")]
                + [Cell(counts(r), "bad" if r.summary is not None and r.summary.failed else "") for r in runs])
    failures = [r.summary.failures if r.summary is not None else {} for r in runs]
    if any(failures):
        rows.append([Cell("Failures by kind")] + [
            Cell(", ".join(f"{k}: {v}" for k, v in sorted(f.items())) if f else "—") for f in failures])
    # A run with failed requests, cut short, or with a NaN figure is never "best": its figures are not comparable.
    rankable = [r.to_row() for r in runs if rankable_run(r)]
    best = best_by_metric(rankable) if len(rankable) > 1 else {}
    for spec in KEY_METRICS:
        if spec.key == "request_throughput":
            continue
        ranking = best.get(spec.key)
        # bold only a clear winner: on a tie (every engine at 0% rejections) bolding one would mislead
        winner = ranking["best_run_id"] if ranking and ranking["tied"] == 1 else None
        rows.append([Cell(spec.title)] + [
            Cell(format_metric(spec, r.metric(spec.key)), "best" if r.run_id == winner else "") for r in runs])
    if any(r.pad_fraction() is not None for r in runs):
        rows.append([Cell("Prompt pad fraction")] + [Cell(fmt.pct(r.pad_fraction())) for r in runs])
    if any(r.decode_idle_fraction() is not None for r in runs):
        rows.append([Cell("Decode idle fraction")] + [Cell(fmt.pct(r.decode_idle_fraction())) for r in runs])
    rows += reasoning_rows(runs)
    # The batch occupancy seen from the client: how well the engine kept its slots decoding.
    rows.append([Cell("Mean requests decoding")] + [Cell(fmt.number(r.mean_decoding())) for r in runs])
    rows += energy_rows(runs)
    rows.append([Cell("Peak KV usage")] + [
        Cell(f"⚠ {fmt.pct(r.server.kv_usage_peak)} (danger zone)", "bad") if r.server.danger_zone
        else Cell(fmt.pct(r.server.kv_usage_peak)) for r in runs])
    if any(r.server.kv_capacity_tokens is not None for r in runs):
        rows.append([Cell("KV capacity (tokens)")] + [Cell(fmt.count(r.server.kv_capacity_tokens)) for r in runs])
    rows.append([Cell("Preemptions (during run)")] + [
        Cell(fmt.count(r.server.preemptions), "bad" if (r.server.preemptions or 0) > 0 else "") for r in runs])
    rows.append([Cell("Max waiting")] + [Cell(fmt.count(r.server.waiting_peak)) for r in runs])
    rows.append([Cell("Max running")] + [Cell(fmt.count(r.server.running_peak)) for r in runs])
    rows.append([Cell("Duration (s)")] + [Cell(fmt.number(r.duration_s)) for r in runs])
    return Table(["Metric", *cols], rows)


def reasoning_rows(runs: list[ReportedRun]) -> list[list[Cell]]:
    """Where a run's streams reasoned: time to the first token of the answer (TTFO) beside TTFT's rows, and the
    reasoning tokens per request; where the engine counted the prompt otherwise than it was sent (a chat
    template's added tokens), both counts per request. Nothing for runs with neither."""
    rows = []
    if any(r.reasoned() for r in runs):
        for title, stat in (("TTFO p50 (ms)", "p50"), ("TTFO p99 (ms)", "p99")):
            rows.append([Cell(title)] + [Cell(fmt.ms(getattr(r.summary.ttfo, stat, None) if r.summary else None))
                                         for r in runs])
        rows.append([Cell("Reasoning tokens / request")] + [
            Cell(fmt.number(r.summary.reasoning_tokens.mean) if r.summary and r.summary.reasoning_tokens else "—")
            for r in runs])
    prompts = [r.prompt_counts() for r in runs]
    if any(p is not None and p[0] != p[1] for p in prompts):
        rows.append([Cell("Prompt tokens / request (sent / engine)")] + [
            Cell("—" if p is None else f"{fmt.number(p[0])} / {fmt.number(p[1])} ({p[1] - p[0]:+.1f})")
            for p in prompts])
    return rows


def energy_rows(runs: list[ReportedRun]) -> list[list[Cell]]:
    """The GPUs' energy per run and what it bought; where no run has figures, one row saying why."""
    found = [r.energy() for r in runs]
    if not any(e is not None and e.energy_j is not None for e in found):
        reasons = [e.unavailable if e is not None and e.unavailable else fmt.NA for e in found]
        return [[Cell("GPU energy")] + [Cell(f"none: {why}" if why != fmt.NA else why) for why in reasons]]
    rows = []
    for title, figure, show in (("GPU energy (J)", "energy_j", fmt.number),
                                ("Output tokens per joule", "tokens_per_joule", fmt.number),
                                ("Joules per request", "joules_per_request", fmt.number),
                                ("USD per million output tokens", "cost_per_million_output_tokens", fmt.number)):
        rows.append([Cell(title)] + [Cell(show(getattr(e, figure)) if e is not None else fmt.NA) for e in found])
    return rows


def rankable_run(run: ReportedRun) -> bool:
    """Whether a run may be bolded best: complete, every request ok, no NaN among its key figures."""
    return (not run.partial and run.summary is not None and run.summary.failed == 0
            and not any(run.nan_metric(spec.key) for spec in KEY_METRICS))


def failure_text(run: ReportedRun) -> str:
    """Why a run's figures are not all they seem: its failed requests by kind (the overview lists these)."""
    s = run.summary
    assert s is not None and s.failures
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(s.failures.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{run.display_name()} ({run.workload_name}): {s.failed} of {s.requests} requests failed: {kinds}"


def repeats_table(runs: list[ReportedRun]) -> Table | None:
    """Each key metric's mean [95% interval] over the repeats of each series; None when nothing repeats."""
    series = [s for s in group_series([r.to_row() for r in runs]) if len(s.rows) > 1]
    if not series:
        return None
    heads = [display_name(s.first.get("engine"), s.first.get("batching_label"), series_labels(s.first))
             for s in series]
    rows = [[Cell("Repeats")] + [Cell(str(len(s.rows))) for s in series]]
    for spec in KEY_METRICS:
        cells = [Cell(spec.title)]
        for s in series:
            spread = s.spread(spec.key)
            cells.append(Cell(fmt.NA if spread is None else
                              f"{format_metric(spec, spread.value)} (n=1)" if spread.low is None or spread.high is None
                              else f"{format_metric(spec, spread.value)} [{format_metric(spec, spread.low)}–"
                              f"{format_metric(spec, spread.high)}]"))
        rows.append(cells)
    return Table(["Metric", *heads], rows,
                 caption="Mean [95% t-interval] over the repeats of one measurement; the runs are under Per-run "
                         "figures.")


def _bucket_labels() -> list[str]:
    """The harness's own bucket names for :data:`BUCKET_EDGES` ('1', '2-3', ... '16+'), in order."""
    return list(ttft_by_bucket([], lambda r: r.in_flight_at_send, BUCKET_EDGES))


def bucket_table(runs: list[ReportedRun]) -> Table:
    """TTFT per batch-size bucket (requests in flight when each was sent): p50 / p99 ms and count."""
    labels = _bucket_labels()
    rows = []
    for name, r in zip(_column_names(runs), runs):
        cells = [Cell(name)]
        for label in labels:
            d = (r.ttft_buckets or {}).get(label) if r.ttft_buckets is not None else None
            if r.ttft_buckets is None:
                cells.append(Cell(fmt.NA))
            elif not isinstance(d, dict):
                cells.append(Cell("—"))
            else:
                cells.append(Cell(f"{fmt.ms(d.get('p50'))} / {fmt.ms(d.get('p99'))} (n={fmt.count(d.get('count'))})"))
        rows.append(cells)
    return Table(["Run", *(f"in flight {label}" for label in labels)], rows,
                 caption="TTFT p50 / p99 in ms (requests) by the number of requests in flight when each was sent; "
                         "— means no request met that batch size.")


def turn_table(runs: list[ReportedRun]) -> Table | None:
    """TTFT per turn of the runs' multi-turn conversations (p50 / p90 ms and count); None when no run has any.

    A later turn carries the whole conversation so far, so this is where a growing context (and a prefix
    cache that spares re-reading it) shows."""
    with_turns = [(name, r.summary.ttft_by_turn) for name, r in zip(_column_names(runs), runs)
                  if r.summary is not None and r.summary.ttft_by_turn]
    if not with_turns:
        return None
    turns = sorted({int(t) for _, by_turn in with_turns for t in by_turn})
    rows = []
    for name, by_turn in with_turns:
        cells = [Cell(name)]
        for turn in turns:
            d = by_turn.get(str(turn))
            cells.append(Cell("—" if d is None else f"{fmt.ms(d.p50)} / {fmt.ms(d.p90)} (n={fmt.count(d.count)})"))
        rows.append(cells)
    return Table(["Run", *(f"turn {t}" for t in turns)], rows,
                 caption="TTFT p50 / p90 in ms (requests) by the turn of the conversation each request was; "
                         "— means no request of that turn succeeded.")


def windows_table(runs: list[ReportedRun], which: str) -> Table | None:
    """Each run's windows, ``slices`` (``--slice``) or ``stages`` (``bench --stages``): a row per window; None
    when no run has any."""
    rows = []
    for name, r in zip(_column_names(runs), runs):
        for w in getattr(r, which):
            span = f"{w.start_s:g}–{w.end_s:g}"
            rows.append([Cell(name), Cell(f"{w.label} ({span})" if w.label else span), Cell(fmt.count(w.sent)),
                         Cell(fmt.count(w.failed)), Cell(f"{w.output_token_throughput:.1f}"),
                         Cell("—" if w.ttft is None else fmt.ms(w.ttft.p50)),
                         Cell("—" if w.ttft is None else fmt.ms(w.ttft.p99)),
                         Cell("—" if w.itl is None else fmt.ms(w.itl.p99)),
                         Cell("—" if w.kv_usage_max is None else f"{w.kv_usage_max:.0%}"),
                         Cell("—" if w.waiting_max is None else f"{w.waiting_max:g}")])
    if not rows:
        return None
    return Table(["Run", "stage (s)" if which == "stages" else "window (s)", "sent", "failed", "out tok/s",
                  "TTFT p50 ms", "TTFT p99 ms", "ITL p99 ms", "KV max", "waiting max"], rows,
                 caption="Each run over windows of its time: the requests sent in a window (and their TTFT), the "
                         "tokens and inter-token gaps that arrived in it, the server's KV usage and queue there."
                         + (" A stage's window is its time; the last runs on to the run's end." if which == "stages"
                            else ""))


def lora_table(runs: list[ReportedRun]) -> Table | None:
    """Each LoRA adapter's share of the runs whose requests named adapters, and Jain's fairness index between
    them; None when no run has any. One heavy adapter, or more adapters than the engine's slots, shows here as
    some adapters' requests waiting longer than others'."""
    with_loras = [(name, r.summary) for name, r in zip(_column_names(runs), runs)
                     if r.summary is not None and r.summary.loras]
    if not with_loras:
        return None
    rows = []
    for name, summary in with_loras:
        assert summary.loras is not None
        for lora, a in summary.loras.items():
            rows.append([Cell(name), Cell(lora), Cell(fmt.count(a.requests)), Cell(fmt.count(a.ok)),
                         Cell("—" if a.ttft is None else fmt.ms(a.ttft.p50)),
                         Cell("—" if a.ttft is None else fmt.ms(a.ttft.p90)), Cell(fmt.rate(a.output_token_throughput)),
                         Cell("—" if a.request_speed is None else fmt.rate(a.request_speed)),
                         Cell("—" if summary.lora_fairness is None else f"{summary.lora_fairness:.3f}")])
    return Table(["Run", "Adapter", "Requests", "Ok", "TTFT p50 (ms)", "TTFT p90 (ms)", "Output tok/s",
                  "Request speed (tok/s)", "Jain's index"], rows,
                 caption="Per LoRA adapter. Request speed: output tokens over latency from the scheduled send, the "
                         "mean over its requests (what its users see, queueing included). Jain's index over the "
                         "adapters' request speeds: 1 when served alike, 1/n when one adapter gets all the service.")


def _baseline_section(cmp: BaselineComparison) -> Section:
    sec = Section("Comparison with baseline")
    sec.blocks.append(Para(
        f"Baseline: {cmp.source}. Runs are matched by engine, batching configuration and workload hash; "
        "repeats of one measurement are compared as means. "
        f"Changes beyond {cmp.threshold_pct:g}% in the worse direction (latency up; throughput and goodput down; "
        "rejections up) are marked as regressions, unless the baseline was repeated and the new mean is "
        "within the 95% interval of its mean (run-to-run noise)."))
    if cmp.environment:
        sec.blocks.append(Para("The baseline ran in another environment; a change may be the machine's, not the "
                               "engine's:", "warn"))
        sec.blocks.append(Bullets(cmp.environment))
    if cmp.limit_shares:
        sec.blocks.append(Para("Each side against the limit on paper of the GPU it ran on (its share of its own "
                               "bound, the mean over its repeats):"))
        sec.blocks.append(Bullets(cmp.limit_shares))
    n = cmp.regressions
    sec.blocks.append(Para(f"{n} regression{'s' if n != 1 else ''} beyond {cmp.threshold_pct:g}% in "
                           f"{len(cmp.matches)} matched run{'s' if len(cmp.matches) != 1 else ''}.",
                           "bad" if n else ""))
    if cmp.matches:
        rows = []
        for m in cmp.matches:
            name = _row_name(m.current)
            if m.current.get("status") != "complete" or m.baseline.get("status") != "complete":
                name += f" (⚠ {m.current.get('status')} vs baseline {m.baseline.get('status')})"
            cells = [Cell(name)]
            for d in m.deltas:
                text = fmt.delta_pct(d.pct)
                if d.pct is None and d.baseline is not None and d.current is not None and d.baseline != d.current:
                    text = f"from {format_metric(METRICS_BY_KEY[d.metric], d.baseline)}"
                if d.regression:
                    cells.append(Cell(f"{text} REGRESSION", "bad"))
                elif d.improvement:
                    cells.append(Cell(f"{text} improved", "best"))
                else:
                    cells.append(Cell(text))
            rows.append(cells)
        sec.blocks.append(Table(["Run", *(s.title for s in KEY_METRICS)], rows,
                                caption="Percent change against the matched baseline (means where repeated)."))
        details = [f"{_row_name(m.current)}: {METRICS_BY_KEY[d.metric].title} "
                   f"{format_metric(METRICS_BY_KEY[d.metric], d.baseline)} → "
                   f"{format_metric(METRICS_BY_KEY[d.metric], d.current)} ({fmt.delta_pct(d.pct)})"
                   for m in cmp.matches for d in m.regressions]
        if details:
            sec.blocks.append(Bullets(details, "bad"))
        notes = [f"{_row_name(m.current)}: {m.note}" for m in cmp.matches if m.note]
        if notes:
            sec.blocks.append(Bullets(notes))
    if cmp.only_current:
        sec.blocks.append(Para("Only in this build (no baseline run to compare with):"))
        sec.blocks.append(Bullets([_row_name(r) for r in cmp.only_current]))
    if cmp.only_baseline:
        sec.blocks.append(Para("Only in the baseline (not run this time):"))
        sec.blocks.append(Bullets([_row_name(r) for r in cmp.only_baseline]))
    return sec


def _row_name(row: dict[str, Any]) -> str:
    wl = row.get("workload") or {}
    repeats = f" x{row['repeats']}" if (row.get("repeats") or 1) > 1 else ""
    return display_name(row.get("engine"), row.get("batching_label"), row.get("labels") or {}) + repeats + \
        f" on {wl.get('name')} ({str(wl.get('hash'))[:12]})"


def _compact(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_compact(v)}" for k, v in value.items() if v is not None) or "—"
    if isinstance(value, list):
        return "; ".join(_compact(v) for v in value) or "—"
    return "—" if value is None else str(value)


def _placement_text(p: Placement | None) -> str:
    """One run's CPU placement in a few words: where the engine and each load-generator process ran."""
    if p is None:
        return "not recorded"
    clients = " / ".join(",".join(map(str, cpus)) for cpus in p.client_cpus)
    engine = f"{p.engine} on CPU {','.join(map(str, p.engine_cpus))}" if p.engine_cpus is not None else p.engine
    state = f"{p.source}, applied" if p.applied else f"not applied: {p.reason}"
    return f"engine {engine}, client CPU {clients} ({state})"


def _engine_version(r: ReportedRun) -> str:
    """The engine's version as its adapter or the packages say it (a server's own build, else the package)."""
    details, packages = r.engine_description.details, r.environment.get("packages") or {}
    found = details.get("version") or packages.get(r.engine) or packages.get(f"{r.engine}-cpu")
    if found is None and isinstance(details.get("versions"), dict):
        found = ", ".join(f"{k} {v}" for k, v in details["versions"].items())
    return str(found) if found else "version not recorded"


def _without_address(args: list[str]) -> list[str]:
    """A server's arguments without the address it was given (a fresh port each start: not what reproduces it)."""
    out: list[str] = []
    for arg in args:
        if out and out[-1] in ("--host", "--port"):
            out.pop()
            continue
        out.append(arg)
    return out


def how_measured_section(runs: list[ReportedRun]) -> Section:
    """Where and how the runs were made, in one block a published comparison can carry: the hardware, each engine's
    version and arguments, the model, the workloads with their hashes and seeds, batchbench's version, the
    placement and any CPU quota, and the command that reproduces it."""
    def each(values: Any) -> str:
        found = sorted({str(v) for v in values if v not in (None, "", [])})
        return "; ".join(found) if found else "not recorded"

    envs = [r.environment for r in runs]
    hardware = each(f"{e.get('cpu')} ({e.get('cpu_count')} CPUs), GPUs: {_compact(e.get('gpus') or None)}; "
                    f"{e.get('platform')}" for e in envs if e).replace("GPUs: —", "no GPU")
    rows = [["Command", each(e.get("command") for e in envs)],
            ["Hardware", hardware],
            ["CPU quota", each(e.get("cpu_quota") or "none" for e in envs if e)],
            ["Placement", each(_placement_text(r.placement) for r in runs)],
            ["batchbench", each(f"{(e.get('packages') or {}).get('batchbench', '?')} at commit "
                                f"{e.get('batchbench_commit') or 'unknown'}" for e in envs if e)],
            ["Model", each(f"{Path(m.path).name} ({'seeded random weights' if m.dummy_weights else 'its weights'})"
                           for r in runs if (m := r.engine_description.model) is not None and m.path)]]
    by_engine: dict[str, set[str]] = defaultdict(set)
    for r in runs:
        args = r.engine_description.server_args
        how = shlex.join(_without_address(args)) if args else f"at {r.engine_description.url} (its own "\
            "configuration)" if r.engine_description.mode == "url" else "in batchbench's process"
        by_engine[r.engine].add(f"{_engine_version(r)}: {how}")
    rows += [[f"Engine {name}", "; ".join(sorted(texts))] for name, texts in sorted(by_engine.items())]
    workloads: dict[tuple[str, int | None], set[str]] = defaultdict(set)
    for r in runs:
        workloads[(r.workload.name, r.workload.spec.seed if r.workload.spec else None)].add(r.workload.hash)
    rows.append(["Workloads", "; ".join(
        f"{name} (seed {seed}): " + (next(iter(hashes))[:12] if len(hashes) == 1 else
                                     f"{len(hashes)} variants (sizes, levels), each hash in its workload's section")
        for (name, seed), hashes in sorted(workloads.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)))])
    return Section("How this was measured", anchor="how-measured", blocks=[Table(
        ["What", "As recorded"], [[Cell(k), Cell(v)] for k, v in rows], prose=True,
        caption="From the runs' own results documents; the command is recorded with its secrets left out.")])


def environment_section(runs: list[ReportedRun]) -> Section:
    """Where each run happened, one table per distinct machine/software set, then the engines' configurations."""
    sec = Section("Environment")
    groups: dict[str, list[ReportedRun]] = defaultdict(list)
    for r in runs:
        groups[canonical(r.environment)].append(r)
    for i, members in enumerate(groups.values(), 1):
        env = members[0].environment
        title = f"Environment {i}" if len(groups) > 1 else "Machine"
        sub = Section(title, level=3)
        if not env:
            sub.blocks.append(Para("No environment recorded."))
        else:
            keys = ["hostname", "platform", "python", "cpu", "cpu_count", "gpus", "packages", "batchbench_commit"]
            keys += [k for k in env if k not in keys]
            placements = "; ".join(sorted({_placement_text(r.placement) for r in members}))
            sub.blocks.append(Table(["Field", "Value"],
                                    [[Cell(k), Cell(_compact(env.get(k)))] for k in keys if k in env]
                                    + [[Cell("cpu placement"), Cell(placements)]]))
        sub.blocks.append(Para("Runs: " + ", ".join(sorted({r.run_id for r in members}))))
        sec.blocks.append(sub)
    rows = []
    for r in sorted(runs, key=lambda r: (r.engine, r.batching_label, r.run_id)):
        extra = {k: v for k, v in codec.encode(r.engine_description).items() if k not in ("engine", "batching")}
        rows.append([Cell(r.run_id), Cell(r.engine), Cell(_compact(codec.encode(r.batching))), Cell(_compact(extra))])
    sec.blocks.append(Section("Engines", level=3, blocks=[Table(["Run", "Engine", "Batching", "Details"], rows)]))
    return sec


def build_document(inputs: Inputs, *, generated_at: str, baseline: BaselineComparison | None,
                   with_plots: bool = True, findings: Findings | None = None) -> Document:
    """Everything the report says, in order: the answer (when there are findings), the overview, the figures,
    the evidence, then each workload's tables."""
    runs = inputs.runs
    doc = Document("batchbench report")
    colors = plots.engine_colors(runs) if with_plots else {}
    if findings is not None:
        first = answer_plots.frontier(findings, colors, answer_plots.accelerators(runs)) if with_plots else None
        doc.sections.append(answer.answer_section(
            findings, [*([first] if first else []), *answer_plots.headlines(findings, colors)] if with_plots else None))
    workloads = group_by_workload(runs)
    doc.sections.append(_overview(inputs, workloads, generated_at, baseline))
    if inputs.claims:
        doc.sections.append(_claims_section(inputs.claims))
    doc.sections.append(how_measured_section(runs))
    if with_plots and findings is not None:
        doc.sections.append(answer_plots.figures_section(findings, runs, colors))
    elif with_plots:
        svg = plots.latency_throughput(runs)
        if svg is not None:
            doc.sections.append(Section("Latency vs throughput", blocks=[Plot(
                "Output tokens/s against TTFT p99, one line per engine configuration; points are labelled by "
                "concurrency (or workload); hollow markers are partial runs.", svg)]))
    if findings is not None:
        doc.sections.append(answer.details_section(findings))
        doc.sections += answer.evidence_sections(findings)
    if inputs.greedy:  # that the engines computed the same thing: beside the evidence, before the raw tables
        doc.sections.append(_agreement_section(inputs.greedy, sorted({r.engine for r in runs})))
    doc.sections += [_workload_section(name, digest, members, colors if with_plots else None)
                     for (name, digest), members in workloads]
    if baseline is not None:
        doc.sections.append(_baseline_section(baseline))
    doc.sections.append(environment_section(runs))
    if inputs.warnings or inputs.ignored:
        doc.sections.append(_skipped_section(inputs))
    return doc


#: The order claims are listed in: what a reader must act on first.
_CLAIM_ORDER = {"failed": 0, "undecided": 1, "not made": 2, "held": 3}


def _claims_section(claims: list[Claim]) -> Section:
    """The pytest session's claims, each with its interval: the undecided ones (their tests skipped) and those
    not made here are listed as plainly as the failed and held ones."""
    counts = {o: sum(c.outcome == o for c in claims) for o in OUTCOMES}
    made = len(claims) - counts["not made"]
    text = (f"The suites made {made} claim{'s' if made != 1 else ''}: {counts['held']} held, {counts['failed']} "
            f"failed, {counts['undecided']} undecided (the interval straddles its limit after the repeats allowed: "
            f"the test skipped); {counts['not made']} not made on this hardware.")
    style: Style = "bad" if counts["failed"] else "warn" if counts["undecided"] else ""
    ordered = sorted(claims, key=lambda c: _CLAIM_ORDER[c.outcome])
    marks: dict[str, Style] = {"failed": "bad", "undecided": "warn"}
    rows = [[Cell(c.outcome, marks.get(c.outcome, "")), Cell(c.test), Cell(c.what)] for c in ordered]
    table = Table(["outcome", "test", "claim, its estimate and interval"], rows, prose=True)
    return Section("Claims", blocks=[Para(text, style), table])


def _agreement_section(answers: list[GreedyOutputs], engines: list[str]) -> Section:
    """How far the engines' greedy answers agree where they computed with the same weights: identical workloads
    shown by identical work (a correctness check beside the speeds)."""
    pairs, alone = agreements(answers)
    intro = (f"Each engine answered the same {len(PROMPTS)} prompts with {N_TOKENS} greedy tokens, batched its own "
             "way. On the same weights two engines should agree but for near-ties their kernels round apart, and "
             "after a first difference the two continuations differ; a narrower dtype on one side makes more ties.")
    blocks: list[Block] = [Para(intro)]
    if pairs:
        rows: list[list[Cell]] = [[
            Cell(f"{p.a.engine} / {p.b.engine}"), Cell(f"{p.a.weights} / {p.b.weights}"),
            Cell(f"{p.share:.0%} ({p.same_tokens} of {p.tokens})", "" if p.share >= 0.5 else "warn"),
            Cell(f"{p.same_outputs} of {p.outputs}"),
            Cell("none" if p.first_difference is None else f"token {p.first_difference + 1:g}"),
        ] for p in pairs]
        blocks.append(Table(["engines", "weights", "tokens that agree", "outputs identical",
                             "first difference (median)"], rows))
    lines = [f"{a.engine}: {a.weights}: compared with no other engine (no other on the same weights)"
             for a in alone]
    answered = {a.engine for a in answers}
    lines += [f"{e}: no greedy answer (its adapter cannot ask this engine for token ids)"
              for e in engines if e not in answered]
    if lines:
        blocks.append(Bullets(lines))
    return Section("Greedy agreement", blocks=blocks)


def _overview(inputs: Inputs, workloads: list[tuple[tuple[str, str], list[ReportedRun]]], generated_at: str,
              baseline: BaselineComparison | None) -> Section:
    """What was read, and what a reader must know before the figures: partial runs, failures, danger, regressions."""
    runs = inputs.runs
    overview = Section("Overview")
    n_partial = sum(r.partial for r in runs)
    overview.blocks.append(Para(
        f"Generated {generated_at}: {len(runs)} run{'s' if len(runs) != 1 else ''} on {len(workloads)} "
        f"workload{'s' if len(workloads) != 1 else ''}, engines: {', '.join(sorted({r.engine for r in runs}))}. "
        f"{len(runs) - n_partial} complete, {n_partial} partial or interrupted. Figures are the harness's stored "
        "summaries; latencies are of successful requests, throughputs divide by the run's wall-clock duration."))
    if n_partial:
        overview.blocks.append(Bullets([_partial_text(r) for r in runs if r.partial], "warn"))
    failing = [r for r in runs if r.summary is not None and r.summary.failures]
    if failing:
        overview.blocks.append(Bullets([failure_text(r) for r in failing], "bad"))
    if danger := _danger_lines(runs):
        overview.blocks.append(Bullets(danger, "bad"))
    if designed := _designed_danger(runs):
        overview.blocks.append(Para(designed))
    if baseline is not None:
        n = baseline.regressions
        overview.blocks.append(Para(f"Against the baseline: {n} regression{'s' if n != 1 else ''} beyond "
                                    f"{baseline.threshold_pct:g}% (see the comparison below).", "bad" if n else ""))
    if inputs.warnings:
        overview.blocks.append(Para(f"{len(inputs.warnings)} file{'s' if len(inputs.warnings) != 1 else ''} "
                                    "skipped (see Skipped files).", "warn"))
    return overview


def _workload_section(name: str, digest: str, members: list[ReportedRun],
                      colors: dict[str, str] | None) -> Section:
    """One workload's tables, and its figures when ``colors`` is given (None: a report without plots)."""
    title = workload_title(name, digest, members[0])
    sec = Section(f"Workload: {title}")
    sec.blocks.append(Para(_workload_intro(name, digest, members)))
    # Repeats merge into one mean [interval] column per series; the per-run table then folds away.
    if (repeated := repeats_table(members)) is not None:
        sec.blocks.append(Section("Across repeats", level=3, blocks=[repeated]))
        sec.blocks.append(Details("Per-run figures", [metrics_table(members)]))
    else:
        sec.blocks.append(metrics_table(members))
    notes = [f"{r.display_name()}: {note}" for r in members for note in r.notes]
    if notes:
        sec.blocks.append(Bullets(notes, "warn"))
    sec.blocks.append(Section("TTFT by batch-size bucket", level=3, blocks=[bucket_table(members)]))
    if (turns := turn_table(members)) is not None:
        sec.blocks.append(Section("TTFT by turn", level=3, blocks=[turns]))
    if (loras := lora_table(members)) is not None:
        sec.blocks.append(Section("LoRA adapters", level=3, blocks=[loras]))
    if (stages := windows_table(members, "stages")) is not None:
        sec.blocks.append(Section("By stage", level=3, blocks=[stages]))
    if (windows := windows_table(members, "slices")) is not None:
        figure = plots.slices_figure(members, colors) if colors is not None else None
        blocks: list[Block] = [] if figure is None else [Plot(
            f"Output tokens/s and TTFT p99 per time window on {title}, a line per sliced run.", figure)]
        sec.blocks.append(Section("Over the run, by time window", level=3,
                                  blocks=[*blocks, Details("Per-window figures", [windows])]))
    # One compact figure per workload, a line per run (one figure per run made the main job's page 12 MB).
    if colors is not None and (svg := plots.workload_figure(members, colors)) is not None:
        sec.blocks.append(Section("TTFT CDF, KV usage and queue depth over time", level=3, blocks=[Plot(
            f"Per run on {title}: the CDF of TTFTs of ok requests, KV usage (the danger zone above the "
            f"dashed line filled) and requests waiting, over the run.", svg)]))
    return sec


def _skipped_section(inputs: Inputs) -> Section:
    """The files read but not reported: unreadable ones (warnings) and JSON that is not batchbench's."""
    sec = Section("Skipped files")
    if inputs.warnings:
        sec.blocks.append(Bullets(inputs.warnings, "warn"))
    if inputs.ignored:
        sec.blocks.append(Para(f"{len(inputs.ignored)} other JSON file{'s' if len(inputs.ignored) != 1 else ''} "
                               "(not batchbench results) ignored: " + ", ".join(inputs.ignored)))
    return sec
