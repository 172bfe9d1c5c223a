"""The main job's greedy answers on disk (``greedy.json`` beside its results documents), for the report's
agreement between engines (:mod:`batchbench.core.greedy`)."""

from __future__ import annotations

import json
from pathlib import Path

from batchbench.core.greedy import GreedyOutputs
from batchbench.results.sidecar import write_sidecar

GREEDY_FILE = "greedy.json"
_SCHEMA = "batchbench.greedy/1"


def write_greedy(folder: Path, answers: list[GreedyOutputs]) -> Path:
    """Write every engine's answer so far (rewritten whole after each engine: an interrupted job keeps them);
    raises OSError where the folder cannot take it."""
    return write_sidecar(folder / GREEDY_FILE, {"schema": _SCHEMA, "answers": [a.to_dict() for a in answers]})


def read_greedy(folder: Path) -> list[GreedyOutputs]:
    """The answers written in ``folder`` (none where there is no such file, or it is not one)."""
    try:
        data = json.loads((folder / GREEDY_FILE).read_text(encoding="utf-8"))
        if data.get("schema") != _SCHEMA:
            return []
        return [GreedyOutputs.from_dict(a) for a in data["answers"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
