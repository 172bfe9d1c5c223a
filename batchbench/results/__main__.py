"""``python -m batchbench.results schema``: the results document's JSON Schema."""

from batchbench.results.document import main

raise SystemExit(main())
