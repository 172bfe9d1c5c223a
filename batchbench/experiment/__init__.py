"""The experiment stage: starting engines, preparing workloads, measuring points with repeats, and the outcome
of a measuring command, between the analysis it reads and the commands and pytest plugin that drive it."""
