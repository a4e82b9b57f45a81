"""``python -m dpddp.cli``: the Lightning CLI (``dpddp.entry.lightning_cli``; the console script ``dpddp``)."""

from dpddp.entry.lightning_cli import main

if __name__ == "__main__":
    main()
