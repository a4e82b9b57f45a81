"""The built-in data and the global-batch plumbing any data set can use. This package imports nothing."""
