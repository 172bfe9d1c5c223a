"""The suites and tests use batchbench's pytest plugin (``batchbench.pytest_plugin``, registered as a
``pytest11`` entry point when batchbench is installed): nothing of its own lives here."""
