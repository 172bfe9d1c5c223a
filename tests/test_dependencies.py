"""Every package the installed modules import when they load is one pyproject.toml declares: ``pip install
batchbench`` alone runs every command. Two were not (safetensors, httpx), found only where a Ray worker in a container
of the bare package unpickled an engine (tests/test_ray_cluster.py); the development venv has both through extras."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The folders that install as batchbench (pyproject.toml's package-dir).
PACKAGE_FOLDERS = ("batchbench", "adapters", "fixtures", "reports")
#: Imported at load only by a module that its own host provides: the pytest plugin, which pytest loads.
PROVIDED = {"pytest"}


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return {re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0].lower().replace("_", "-")
            for spec in project["dependencies"]}


def _imported_at_load() -> dict[str, set[str]]:
    """Third-party top-level names each module imports unconditionally (module level, outside ``try``)."""
    found: dict[str, set[str]] = {}
    for folder in PACKAGE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "batchbench":
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_package_imported_at_load_is_a_declared_dependency() -> None:
    distributions = md.packages_distributions()
    declared = _declared()
    missing = {top: sorted(files) for top, files in _imported_at_load().items()
               if top not in PROVIDED and not {d.lower().replace("_", "-") for d in distributions.get(top, [top])}
               & declared}
    assert not missing, f"imported when a module loads, not in pyproject.toml's dependencies: {missing}"
