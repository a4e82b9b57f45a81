"""Test helpers that make one rank late (``+callbacks.<name>._target_=slow_rank.<Class>``, with ``tests/`` on
``PYTHONPATH``). ``SlowRank``, a straggler: global rank ``rank`` (``None``: every rank) sleeps ``sleep_s`` seconds
at the start of each training batch, inside the step that ``dpddp.diagnostics.costs.Costs`` times. ``NeverArrives``: a
rank that does not reach a collective."""

from __future__ import annotations

import time

import lightning.pytorch as pl


class SlowRank(pl.Callback):
    def __init__(self, rank: int | None = 1, sleep_s: float = 0.1) -> None:
        self.rank, self.sleep_s = rank, sleep_s

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if self.rank is None or trainer.global_rank == self.rank:
            time.sleep(self.sleep_s)


class NeverArrives(pl.Callback):
    """Global rank ``rank`` sleeps ``sleep_s`` seconds before the backward of step ``at_step`` (well past the
    collectives' timeout): the other ranks wait for it in the gradient all-reduce."""

    def __init__(self, rank: int = 1, at_step: int = 5, sleep_s: float = 600.0) -> None:
        self.rank, self.at_step, self.sleep_s = rank, at_step, sleep_s

    def on_before_backward(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.at_step:
            time.sleep(self.sleep_s)
