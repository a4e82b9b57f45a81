"""A run's outputs: throughput, epoch table, progress bars, predictions, metric contract, metrics.json, curves."""
