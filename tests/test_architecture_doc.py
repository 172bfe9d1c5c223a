"""docs/architecture.md names modules that exist: its table of folders lists, per folder, the modules that hold
each concept, and a renamed or removed module must not leave the page pointing at nothing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
#: A cell's backticked word that names a module or a package: ``runner``, ``findings/``, ``spec.EngineSpec``.
MODULE = re.compile(r"`([a-z_][a-z0-9_]*)(?:\.[A-Za-z_]+)?/?`")


def table_rows() -> list[tuple[Path, str]]:
    """(folder, role cell) of every row of the page's table of folders."""
    rows = []
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and "/`" in cells[0]:
            rows.append((ROOT / cells[0].split("`")[1], cells[2]))
    return rows


def test_the_table_lists_every_folder_of_the_repository_it_describes() -> None:
    folders = {folder.relative_to(ROOT).as_posix() for folder, _ in table_rows()}
    assert {"batchbench", "batchbench/core", "batchbench/results", "batchbench/analysis",
            "batchbench/analysis/findings", "adapters", "reports", "fixtures", "suites", "tests", "docker",
            "docs"} <= folders


def test_every_module_the_table_names_exists_in_its_folder() -> None:
    missing = []
    for folder, role in table_rows():
        present = {p.stem for p in folder.rglob("*.py")} | {p.name for p in folder.rglob("*") if p.is_dir()} \
            | {p.stem for p in folder.rglob("*.sh")} | {p.stem for p in folder.rglob("*.toml")} \
            | {p.stem for p in folder.rglob("*.md")}
        missing += [f"{folder.relative_to(ROOT)}: {name}" for name in MODULE.findall(role) if name not in present]
    assert missing == []
