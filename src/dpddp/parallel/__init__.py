"""The parallel plumbing: the ``dp`` strategy, the DDP strategy, the launcher and the launched-rank entry. Nothing
here imports the run or entry layers: a launched rank finds its work through ``RankJob.entry``."""
