"""A run's numbers: the metrics it writes, its summary, the comparison of runs
(`python -m asyncfp8.report`), plots, statistics and the collapse count."""
