"""What a run measured, as figures: per-request metrics, the client's and the machine's load, guardrails, speculation
counters, token parity and the SLO. Takes records and samples; gives the numbers the results and analysis hold."""
