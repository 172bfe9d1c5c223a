"""Reading Prometheus text exposition, for every engine's /metrics.

Parsing is prometheus_client's own parser; this module only indexes the
samples so adapters can pick the names their engine uses. That parser is
pure Python and vLLM's /metrics runs to hundreds of histogram lines: parsing
it all took ~0.15 s of the load generator's event loop per scrape on a CPU
core, so adapters name the families they read and the rest is dropped
before parsing.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Samples:
    """All samples of one scrape, keyed by sample name (``_total`` etc. included)."""

    by_name: dict[str, list[tuple[dict[str, str], float]]]

    @classmethod
    def parse(cls, text: str, keep: tuple[str, ...] | None = None) -> Samples:
        """Index the samples; with ``keep``, only metrics whose names start with one of those prefixes."""
        if keep is not None:
            text = "\n".join(_kept_lines(text, keep)) + "\n"
        by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                by_name.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
        return cls(by_name)

    def sum(self, *names: str) -> float | None:
        """Sum over all label sets of the first name present (engines rename metrics across versions)."""
        for name in names:
            if name in self.by_name:
                return sum(value for _, value in self.by_name[name])
        return None

    def label(self, name: str, label: str) -> str | None:
        """A label's value on the first sample of ``name`` (info-style metrics)."""
        for labels, _ in self.by_name.get(name, []):
            if label in labels:
                return labels[label]
        return None

    def __contains__(self, name: str) -> bool:
        return name in self.by_name


def _kept_lines(text: str, keep: tuple[str, ...]) -> list[str]:
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)  # "# HELP name ..." / "# TYPE name type"
            if len(parts) >= 3 and parts[2].startswith(keep):
                kept.append(line)
        elif line.startswith(keep):
            kept.append(line)
    return kept
