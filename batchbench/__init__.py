"""batchbench: batch size vs latency, measured on real LLM serving engines.

One import name for the whole tool: the repository's top-level folders install as subpackages
(``adapters/`` is ``batchbench.adapters``, ``fixtures/`` is ``batchbench.fixtures``, ``reports/`` is
``batchbench.reports``; see pyproject.toml).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _require_installed_layout() -> None:
    """Fail with the fix, not a bare ModuleNotFoundError, when run from a checkout that is not installed.

    From a source checkout (the working directory, or pytest's rootdir, first on ``sys.path``) this
    folder is found as ``batchbench``, but its subpackages live in sibling folders that only the
    editable install maps in; a regular install elsewhere cannot help, since this folder wins.
    """
    if importlib.util.find_spec(f"{__name__}.adapters") is None:
        root = Path(__file__).resolve().parent.parent
        raise ImportError(
            f"batchbench is imported from the source tree {root.name}/ but is not installed from it in editable "
            "mode, so batchbench.adapters cannot be found: run ./bootstrap.sh (or pip install -e .) there"
        )


_require_installed_layout()
