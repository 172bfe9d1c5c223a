"""The load stage: sends a workload to an engine (open or closed loop, from one process or several), scrapes its
metrics and writes each run's results document. Takes a workload and an engine; gives results documents."""
