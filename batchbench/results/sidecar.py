"""A JSON file a results folder keeps beside its documents (a session's claims, the main job's greedy answers),
replaced whole: written beside its final name, then renamed, so a reader never sees half of one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_sidecar(path: Path, doc: dict[str, Any]) -> Path:
    """Write ``doc`` to ``path`` atomically; an OSError (a full or unwritable folder) leaves no temporary file and
    the last whole file in place, and is raised."""
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return path
