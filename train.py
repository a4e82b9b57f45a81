"""Train: ``python train.py [key=value ...]``, ``python train.py -m ...`` for sweeps (see README)."""

from dpddp.entry.hydra import main

if __name__ == "__main__":
    main()
