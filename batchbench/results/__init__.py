"""The results document: one typed, versioned JSON per run (header, records, samples, footer), journalled as the run
goes. Takes what the load stage measured; gives documents the analysis and the reports read."""
