"""Steady-state training throughput in samples/s over all processes and all segments of a run."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from dpddp.report.tally import FitTally


@dataclass
class ThroughputCounts:
    """The resumable counts behind ``Throughput`` and ``Costs`` (``fallback_*``: the steps' own times)."""

    samples: int = 0
    seconds: float = 0.0
    fallback_samples: int = 0
    fallback_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    peak_mem_mib: float = 0.0
    compute_s_per_rank: list[float] = field(default_factory=list)
    wait_s_per_rank: list[float] = field(default_factory=list)
    ranks_epoch: int = -1

    @property
    def samples_per_sec(self) -> float:
        """Samples per second (``nan`` before any step)."""
        samples, seconds = self.samples, self.seconds
        if not samples:
            samples, seconds = self.fallback_samples, self.fallback_seconds
        return samples / seconds if seconds > 0 else float("nan")


class Throughput(pl.Callback):
    """Steady-state samples/s between an epoch's step ends (one step an epoch: its time), at fit end as ``KEY``."""

    KEY = "perf/samples_per_sec"
    FIRST_STEP_KEY = "perf/first_step_unix_s"

    def __init__(self, tally: FitTally) -> None:
        self.tally, self.counts = tally, ThroughputCounts()
        self.first_step_unix_s: float | None = None  # wall-clock time (time.time()) of the first step's end
        self._last: float | None = None
        self._batch_start = 0.0

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._batch_start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        now, counts = time.perf_counter(), self.counts
        if self.first_step_unix_s is None:
            self.first_step_unix_s = time.time()
        batch = self.tally.samples
        if self._last is not None:
            counts.samples += batch
            counts.seconds += now - self._last
        counts.fallback_samples += batch
        counts.fallback_seconds += now - self._batch_start
        self._last = now

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.callback_metrics[self.KEY] = torch.tensor(self.counts.samples_per_sec, dtype=torch.float64)
        if self.first_step_unix_s is not None:
            trainer.callback_metrics[self.FIRST_STEP_KEY] = torch.tensor(self.first_step_unix_s, dtype=torch.float64)
