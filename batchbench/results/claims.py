"""A pytest session's claims on disk: what each suite claimed of an engine, and whether it held.

The suites decide each claim by its interval (:class:`batchbench.pytest_plugin.IntervalChecks`); a claim whose
interval straddles its limit skips its test. Written beside the session's results documents, they reach the
report, which lists the undecided and failed ones with their intervals, so a skip is not lost in pytest's output.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, get_args

from batchbench.results.sidecar import write_sidecar

ClaimOutcome = Literal["held", "failed", "undecided", "not made"]
OUTCOMES: tuple[ClaimOutcome, ...] = get_args(ClaimOutcome)
#: The file a session's claims are written to, in its results folder.
CLAIMS_FILE = "claims.json"
_SCHEMA = "batchbench.claims/1"


@dataclass(frozen=True)
class Claim:
    """One claim a test made (or could not make here), with its figures, and what became of it."""

    test: str
    what: str
    outcome: ClaimOutcome


def write_claims(folder: Path, claims: list[Claim]) -> Path:
    """Write ``claims`` to ``folder``/:data:`CLAIMS_FILE` (replaced whole: a later session's folder is its own)."""
    return write_sidecar(folder / CLAIMS_FILE, {"schema": _SCHEMA, "claims": [asdict(c) for c in claims]})


def read_claims(folder: Path) -> list[Claim]:
    """The claims written in ``folder`` (none where there is no claims file, or it is not one)."""
    try:
        data = json.loads((folder / CLAIMS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict) or data.get("schema") != _SCHEMA or not isinstance(data.get("claims"), list):
        return []
    return [Claim(str(c["test"]), str(c["what"]), c["outcome"]) for c in data["claims"]
            if isinstance(c, dict) and c.get("outcome") in OUTCOMES and {"test", "what"} <= c.keys()]
