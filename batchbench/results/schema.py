"""The results document's JSON Schema, made from its types: ``python -m batchbench.results schema``."""

from __future__ import annotations

import json
import sys
from typing import Any

from batchbench.core import codec
from batchbench.core.records import RequestRecord
from batchbench.core.server_metrics import ServerMetrics
from batchbench.measures.gpu import GpuSample
from batchbench.results.document import SCHEMA, SCHEMA_VERSION, RunFooter, RunHeader


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a results document of this version, from the types above."""
    defs: dict[str, Any] = {}
    header = codec.fields_of(RunHeader)
    footer = codec.fields_of(RunFooter)
    props: dict[str, Any] = {
        "schema": {"const": SCHEMA},
        "schema_version": {"const": SCHEMA_VERSION, "description": "major version; additions keep it"},
    }
    props |= {f.name: codec.field_schema(f, hint, defs) for f, hint in header}
    props["records"] = codec.type_schema(list[RequestRecord], defs) | {
        "description": "every request, in completion order"}
    props["server_metrics"] = codec.type_schema(list[ServerMetrics], defs) | {
        "description": "the scraped time series"}
    props["gpu_samples"] = codec.type_schema(list[GpuSample], defs) | {
        "description": "the GPU telemetry's samples, every sampled GPU at each moment (absent before it was recorded)"}
    props |= {f.name: codec.field_schema(f, hint, defs) for f, hint in footer}
    props["status"] = {"type": "string", "description": RunFooter.__dataclass_fields__["status"].metadata["doc"]}
    footer_keys = [f.name for f, _ in footer]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://batchbench.invalid/{SCHEMA}/v{SCHEMA_VERSION}.schema.json",
        "title": f"{SCHEMA} v{SCHEMA_VERSION}",
        "description": "One batchbench run: header, request records, server metrics, footer (absent when "
                       "partial). Written by batchbench.results.journal.JournalWriter, read by RunDocument.load.",
        "type": "object",
        "properties": props,
        "required": ["schema", "schema_version", *(f.name for f, _ in header), "records", "server_metrics",
                     "gpu_samples", "status"],
        "additionalProperties": False,
        # A partial document (a killed run's journal, folded) has no footer; any other has all of it.
        "if": {"properties": {"status": {"const": "partial"}}},
        "then": {"not": {"anyOf": [{"required": [k]} for k in footer_keys if k != "status"]}},
        "else": {"required": footer_keys},
        "$defs": dict(sorted(defs.items())),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["schema"]:
        print("usage: python -m batchbench.results schema > results.schema.json", file=sys.stderr)
        return 2
    print(json.dumps(json_schema(), indent=2))
    return 0
