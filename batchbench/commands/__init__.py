"""The ``batchbench`` subcommands, one module each, with what they share in :mod:`.common`."""
