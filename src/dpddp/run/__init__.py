"""The run: the config check, the trainer's assembly, and ``training.train``, which every entry point calls."""
