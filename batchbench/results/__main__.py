"""``python -m batchbench.results schema``: the results document's JSON Schema."""

from batchbench.results.schema import main

raise SystemExit(main())
