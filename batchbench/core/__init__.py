"""The core types every stage speaks: the clock, a request's record, a server-metrics sample, the configuration
(batching, model, capabilities, KV layout, load) and the CPU placement. Takes nothing of batchbench; gives types."""
