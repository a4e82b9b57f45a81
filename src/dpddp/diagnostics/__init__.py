"""Diagnostics: the network interface and check, all-reduce bandwidth, the ranks' whereabouts, the all-reduce
timer and the run's costs. The package imports nothing, so that ``cluster`` reaches ``network`` (stdlib only)
without torch; the rest of the project uses only the names ``tests/test_diagnostics.py`` lists."""
