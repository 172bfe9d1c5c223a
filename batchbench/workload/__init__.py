"""The workload: seeded requests (synthetic lengths, datasets, profiles, LoRA traffic), identical for every engine.
Takes the core types; gives the requests a run sends."""
