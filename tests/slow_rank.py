"""A test helper that makes one rank a straggler (``+callbacks.<name>._target_=slow_rank.SlowRank``, with ``tests/``
on ``PYTHONPATH``): global rank ``rank`` (``None``: every rank) sleeps ``sleep_s`` seconds at the start of each
training batch, inside the step that ``dpddp.report.costs.Costs`` times."""

from __future__ import annotations

import time

import lightning.pytorch as pl


class SlowRank(pl.Callback):
    def __init__(self, rank: int | None = 1, sleep_s: float = 0.1) -> None:
        self.rank, self.sleep_s = rank, sleep_s

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if self.rank is None or trainer.global_rank == self.rank:
            time.sleep(self.sleep_s)
