"""Evaluate a checkpoint: ``python eval.py ckpt_path=<a run's checkpoints/last.ckpt> [key=value ...]`` (see README)."""

from dpddp.entry.eval import main

if __name__ == "__main__":
    main()
