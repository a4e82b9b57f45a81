"""Evaluate a checkpoint: ``python eval.py ckpt_path=<a run's checkpoints/last.ckpt> [key=value ...]`` (see README)."""

from dpddp.cluster import refuse_non_integer_variables

if __name__ == "__main__":
    refuse_non_integer_variables()  # before torch: torchmetrics reads LOCAL_RANK as a number on import

from dpddp.entry.eval import main  # noqa: E402

if __name__ == "__main__":
    main()
