"""The run: config check, trainer assembly, callbacks, checkpoint IO, and ``training.train``, the one function
every entry point calls."""
