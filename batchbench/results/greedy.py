"""The main job's greedy answers on disk (``greedy.json`` beside its results documents), for the report's
agreement between engines (:mod:`batchbench.core.greedy`)."""

from __future__ import annotations

import json
from pathlib import Path

from batchbench.core.greedy import GreedyOutputs

GREEDY_FILE = "greedy.json"
_SCHEMA = "batchbench.greedy/1"


def write_greedy(folder: Path, answers: list[GreedyOutputs]) -> Path:
    """Write every engine's answer so far (rewritten whole after each engine: an interrupted job keeps them);
    raises OSError where the folder cannot take it."""
    path = folder / GREEDY_FILE
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps({"schema": _SCHEMA, "answers": [a.to_dict() for a in answers]}) + "\n",
                       encoding="utf-8")
        tmp.replace(path)
    except OSError:  # a full or unwritable folder: no half-written file beside the last whole one
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_greedy(folder: Path) -> list[GreedyOutputs]:
    """The answers written in ``folder`` (none where there is no such file, or it is not one)."""
    try:
        data = json.loads((folder / GREEDY_FILE).read_text(encoding="utf-8"))
        if data.get("schema") != _SCHEMA:
            return []
        return [GreedyOutputs.from_dict(a) for a in data["answers"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
