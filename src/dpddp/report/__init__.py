"""Every output of a run: throughput, the epoch table and lines, progress bars, predictions, the metric contract,
``metrics.json`` and the curves."""
