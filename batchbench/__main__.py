from batchbench.cli import main

raise SystemExit(main())
