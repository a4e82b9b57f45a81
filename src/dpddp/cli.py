"""``python -m dpddp.cli``: the Lightning CLI (``dpddp.entry.cli``; the console script ``dpddp`` is the same)."""

from dpddp.entry.cli import main

if __name__ == "__main__":
    main()
