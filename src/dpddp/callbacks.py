"""Callbacks: training throughput (Lightning) and the sweep summary (Hydra)."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl

__all__ = ["Throughput"]


class Throughput(pl.Callback):
    """Steady-state training throughput in samples/s over all processes.

    Counts the intervals between consecutive ``on_train_batch_end`` calls within an epoch (so data loading and
    the step are in, while start-up, the first step of each epoch and validation are out), each worth one
    global batch (``datamodule.batch_size`` samples). With a single step per epoch it falls back to the step
    times alone. Cheap: one ``time.perf_counter()`` per step, no sync.
    """

    def __init__(self) -> None:
        self.samples = 0
        self.seconds = 0.0
        self.fallback = [0, 0.0]
        self._last: float | None = None
        self._batch_start = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        batch = trainer.datamodule.batch_size
        if self._last is not None:
            self.samples += batch
            self.seconds += now - self._last
        self.fallback[0] += batch
        self.fallback[1] += now - self._batch_start
        self._last = now

    @property
    def samples_per_sec(self) -> float:
        """Samples per second (``nan`` before any step)."""
        samples, seconds = (self.samples, self.seconds) if self.samples else self.fallback
        return samples / seconds if seconds > 0 else float("nan")
