"""The report's figures as CSV for other tools: one row per run, and (on request) one row per request.

``runs_csv`` has the rows of the report's per-run tables, one run a row in the report's order (workload, then
engine, configuration and labels), each figure of the table a column. Values are the stored ones in their
units, not the table's rounded text: seconds (``_s``), fractions (``_fraction``, ``rejection_rate``), rates per
second, counts; an empty cell where the table says n/a. ``records_csv`` has every request record of every run,
with the run's identifying columns, so a user's own tooling can recompute any statistic.

CSV only: Parquet would need pyarrow, which batchbench does not depend on; every dataframe library and
spreadsheet reads these files.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable
from typing import Any

from batchbench.core.records import RequestRecord
from batchbench.reports.content import group_by_workload
from batchbench.reports.inputs import Inputs
from batchbench.reports.model import KEY_METRICS, MetricSpec, ReportedRun

#: Column-name suffix per metric unit: stored values are seconds, per-second rates and fractions.
_UNIT_SUFFIX = {"ms": "_s", "rate": "", "fraction": ""}


def metric_column(spec: MetricSpec) -> str:
    """The CSV column of a key metric: its key, with ``_s`` where the value is in seconds."""
    return spec.key + _UNIT_SUFFIX[spec.unit]


def _label_keys(runs: Iterable[ReportedRun]) -> list[str]:
    """Every label any run has (concurrency, repeat, layout, ...), each a column of its own."""
    return sorted({key for run in runs for key, _ in run.run_labels.items()})


def _identity_header(label_keys: list[str]) -> list[str]:
    """The names of :func:`_identity`'s columns, in order."""
    return ["source", "run_id", "engine", "batching", "workload", "workload_hash",
            *(f"label_{key}" for key in label_keys)]


def _identity(run: ReportedRun, label_keys: list[str]) -> dict[str, Any]:
    """The columns that say which run a row belongs to."""
    return {"source": run.source, "run_id": run.run_id, "engine": run.engine, "batching": run.batching_label,
            "workload": run.workload_name, "workload_hash": run.workload_hash,
            **{f"label_{key}": _cell(run.run_labels.value(key)) for key in label_keys}}


def _cell(value: Any) -> Any:
    """A value as a CSV cell: None empty, a list or mapping as compact JSON, anything else as it is."""
    if value is None:
        return ""
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return value


def _ordered(inputs: Inputs) -> list[tuple[ReportedRun, int]]:
    """Each run (with its index in ``inputs``) in the order the report shows them."""
    index = {id(run): i for i, run in enumerate(inputs.runs)}
    return [(run, index[id(run)]) for _, members in group_by_workload(inputs.runs) for run in members]


def _write(header: list[str], rows: Iterable[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=header, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: _cell(value) for key, value in row.items()})
    return out.getvalue()


def runs_csv(inputs: Inputs) -> str:
    """One row per run: the per-run table's figures (status, requests, failures by kind, the key metrics, padding,
    decode idleness, batch occupancy, the engine's KV and queue figures, duration)."""
    label_keys = _label_keys(inputs.runs)
    header = [*_identity_header(label_keys), "status", "summary_source", "started_at", "requests", "ok", "failed",
              "failures", *(metric_column(spec) for spec in KEY_METRICS), "ttfo_p50_s", "ttfo_p99_s",
              "reasoning_tokens_mean", "prompt_tokens_sent_mean", "prompt_tokens_engine_mean", "prompt_pad_fraction",
              "decode_idle_fraction", "mean_decoding", "kv_usage_peak", "kv_danger_zone", "kv_capacity_tokens",
              "preemptions", "rejections", "waiting_peak", "running_peak", "duration_s"]

    def row(run: ReportedRun) -> dict[str, Any]:
        s, server = run.summary, run.server
        return {
            **_identity(run, label_keys), "status": run.status, "summary_source": run.summary_source,
            "started_at": run.started_at, "requests": s.requests if s else None, "ok": s.ok if s else None,
            "failed": s.failed if s else None, "failures": dict(s.failures) if s and s.failures else None,
            **{metric_column(spec): run.metric(spec.key) for spec in KEY_METRICS},
            "ttfo_p50_s": s.ttfo.p50 if s and s.ttfo else None, "ttfo_p99_s": s.ttfo.p99 if s and s.ttfo else None,
            "reasoning_tokens_mean": s.reasoning_tokens.mean if s and s.reasoning_tokens else None,
            "prompt_tokens_sent_mean": s.prompt_tokens_sent.mean if s and s.prompt_tokens_sent else None,
            "prompt_tokens_engine_mean": s.prompt_tokens_engine.mean if s and s.prompt_tokens_engine else None,
            "prompt_pad_fraction": run.pad_fraction(), "decode_idle_fraction": run.decode_idle_fraction(),
            "mean_decoding": run.mean_decoding(), "kv_usage_peak": server.kv_usage_peak,
            "kv_danger_zone": server.danger_zone, "kv_capacity_tokens": server.kv_capacity_tokens,
            "preemptions": server.preemptions, "rejections": server.rejections, "waiting_peak": server.waiting_peak,
            "running_peak": server.running_peak, "duration_s": run.duration_s,
        }

    return _write(header, (row(run) for run, _ in _ordered(inputs)))


#: The request record's own fields exported as they are stored (times in seconds from the run's start).
_RECORD_FIELDS = ("request_id", "ok", "error_kind", "error", "prompt_len", "max_tokens", "prompt_tokens",
                  "completion_tokens", "finish_reason", "scheduled_s", "sent_s", "done_s", "closed_s",
                  "in_flight_at_send", "priority", "wave", "session", "turn", "lora", "reasoning_tokens",
                  "first_output_s", "usage_from")


def records_csv(inputs: Inputs) -> str:
    """One row per request of every run: the record as stored, with its derived latencies (TTFT and E2E from the
    send, E2E from the scheduled send, schedule lag), output tokens and chunk count, after the run's columns."""
    label_keys = _label_keys(inputs.runs)
    header = [*_identity_header(label_keys), *_RECORD_FIELDS, "output_tokens", "chunks", "ttft_s", "ttfo_s", "e2e_s",
              "e2e_from_schedule_s", "schedule_lag_s"]

    def row(run: ReportedRun, record: RequestRecord) -> dict[str, Any]:
        return {**_identity(run, label_keys), **{name: getattr(record, name) for name in _RECORD_FIELDS},
                "output_tokens": record.output_tokens, "chunks": len(record.chunk_times), "ttft_s": record.ttft_s,
                "ttfo_s": record.ttfo_s, "e2e_s": record.e2e_s, "e2e_from_schedule_s": record.e2e_from_schedule_s,
                "schedule_lag_s": record.schedule_lag_s}

    return _write(header, (row(run, record) for run, i in _ordered(inputs)
                           for record in inputs.documents[i].records))
