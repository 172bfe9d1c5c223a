"""The analysis: repeats and their intervals, validity, regimes, the capacity search, batching theory, the memory
planner and the findings. Takes results documents; gives findings and decisions for the reports and the CLI."""
