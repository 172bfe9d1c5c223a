"""The stages of the package and the one rule between them, as code the layering tests run on any copy of the tree.

Each module belongs to exactly one stage, found from its import name; a stage may import only itself and the
stages below it, and no modules import each other in a cycle. Imports under ``if TYPE_CHECKING:`` never run and
are left out; imports inside functions count (a cycle broken only by a late import is still a cycle in the design).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

#: Bottom first. A stage is its import-name prefixes: a module is in the stage of the longest prefix it starts with.
#: The front's modules are named one by one, so a new flat module of ``batchbench/`` belongs to no stage until it
#: is put in one.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("batchbench.core",)),
    ("models", ("batchbench.fixtures",)),
    ("workload", ("batchbench.workload",)),
    ("adapters", ("batchbench.adapters",)),
    ("measures", ("batchbench.measures",)),
    ("protocol servers", ("batchbench.fixtures.protocol",)),
    ("results", ("batchbench.results",)),
    ("load", ("batchbench.load",)),
    ("analysis", ("batchbench.analysis",)),
    ("reports", ("batchbench.reports",)),
    ("experiment", ("batchbench.experiment",)),
    ("front", ("batchbench", "batchbench.__main__", "batchbench.cli", "batchbench.commands", "batchbench.options",
               "batchbench.pytest_plugin", "batchbench.selftest")),
)

#: Where each import name's source lives in the repository (pyproject.toml's package-dir).
PACKAGE_DIRS = {"batchbench": "batchbench", "batchbench.adapters": "adapters", "batchbench.fixtures": "fixtures",
                "batchbench.reports": "reports"}


@dataclass(frozen=True)
class Layering:
    """What the rule found over one tree: every problem as a sentence (empty: the tree keeps the rule)."""

    modules: dict[str, Path]
    unplaced: list[str]
    upward: list[str]
    cycles: list[list[str]]

    @property
    def problems(self) -> list[str]:
        return ([f"{m} is in no stage (add it to tests/layering.py STAGES)" for m in self.unplaced]
                + self.upward + [" -> ".join([*c, c[0]]) + " is a cycle" for c in self.cycles])


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root``, by import name."""
    found: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = [p for p in path.relative_to(base).with_suffix("").parts if p != "__init__"]
            if package == "batchbench" and parts and f"batchbench.{parts[0]}" in PACKAGE_DIRS:
                continue
            found[".".join([package, *parts])] = path
    return found


def stage_of(module: str) -> int | None:
    """The index of the module's stage in :data:`STAGES` (None: none)."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(STAGES):
        for prefix in prefixes:
            matches = module == prefix or (module.startswith(prefix + ".") and prefix != "batchbench")
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``path`` imports: ``from P import N`` is P.N where that is a module, else P."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in known:
            for alias in node.names:
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative so a deep chain
    cannot hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def check(root: Path) -> Layering:
    """The rule over the tree at ``root`` (the repository, or a copy of it)."""
    known = modules(root)
    graph = {m: imports(p, known) - {m} for m, p in known.items()}
    unplaced = sorted(m for m in known if stage_of(m) is None)
    upward = []
    for module, targets in sorted(graph.items()):
        own = stage_of(module)
        for target in sorted(targets):
            theirs = stage_of(target)
            if own is not None and theirs is not None and theirs > own:
                upward.append(f"{module} ({STAGES[own][0]}) imports {target} ({STAGES[theirs][0]}), a stage above it")
    return Layering(known, unplaced, upward, _cycles(graph))
