"""Where a run's memory and time go: peak memory per process and the share of the training steps spent waiting
on the gradient all-reduce, the largest (memory) and the mean (share) over ranks."""

from __future__ import annotations

import resource
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from dpddp.parallel.ddp import DDPStrategy
from dpddp.parallel.dp import DataParallelStrategy
from dpddp.report.throughput import ThroughputCounts

__all__ = ["Costs", "peak_memory_mib"]


def peak_memory_mib(trainer: pl.Trainer) -> tuple[float, str]:
    """This process's peak memory in MiB and what it counts: ``"rss"`` (CPU: the resident set's high-water mark,
    ``getrusage``), ``"cuda_max_allocated"`` (GPUs: ``torch.cuda.max_memory_allocated``, the largest over the
    GPUs this process drives)."""
    strategy = trainer.strategy
    if strategy.root_device.type == "cuda":
        devices = strategy.parallel_devices if isinstance(strategy, DataParallelStrategy) else [strategy.root_device]
        peak = max(torch.cuda.max_memory_allocated(d) for d in devices or [strategy.root_device])
        return peak / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss"  # KiB on Linux


class Costs(pl.Callback):
    """At each epoch's end ``epoch`` holds the peak memory (MiB, the largest over ranks) and, under ddp, the
    epoch's share of step time (``on_train_batch_start`` to ``_end``) that backward waited on the all-reduce
    (``dpddp.parallel.allreduce.AllReduceTimer``; the mean over ranks); published at ``on_fit_end`` over the run
    (``counts``, resumable) under ``MEMORY_KEY`` and ``SHARE_KEY``. Two all-reduces per epoch and two at the end."""

    MEMORY_KEY = "perf/peak_mem_mib"
    SHARE_KEY = "perf/allreduce_share"

    def __init__(self, counts: ThroughputCounts) -> None:
        self.counts = counts
        self.kind = "rss"
        self.epoch: dict[str, float] = {}
        self._base, self._epoch_start = 0.0, (0.0, 0.0)

    def _timer_seconds(self, trainer: pl.Trainer, settle: bool = False) -> float | None:
        strategy = trainer.strategy
        timer = strategy.allreduce_timer if isinstance(strategy, DDPStrategy) else None
        if timer is None:
            return None
        return self._base + (timer.settle() if settle else timer.seconds)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._base = self.counts.allreduce_seconds
        if isinstance(trainer.strategy, DDPStrategy) and trainer.strategy.allreduce_timer is not None:
            trainer.strategy.allreduce_timer.reset()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start = self.counts.allreduce_seconds, self.counts.fallback_seconds

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        seconds = self._timer_seconds(trainer)
        if seconds is not None:
            self.counts.allreduce_seconds = seconds

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seconds = self._timer_seconds(trainer, settle=True)
        waited = (seconds - self._epoch_start[0]) if seconds is not None else None
        stepped = self.counts.fallback_seconds - self._epoch_start[1]
        self.epoch = self._over_ranks(trainer, waited, stepped)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seconds = self._timer_seconds(trainer, settle=True)
        if seconds is not None:
            self.counts.allreduce_seconds = seconds
        waited = self.counts.allreduce_seconds if seconds is not None else None
        found = self._over_ranks(trainer, waited, self.counts.fallback_seconds)
        peak = max(found["peak_mem_mib"], self.counts.peak_mem_mib)  # a continued run: its earlier segments too
        self.counts.peak_mem_mib = peak
        trainer.callback_metrics[self.MEMORY_KEY] = torch.tensor(peak, dtype=torch.float64)
        if "allreduce_share" in found:
            trainer.callback_metrics[self.SHARE_KEY] = torch.tensor(found["allreduce_share"], dtype=torch.float64)

    def _over_ranks(self, trainer: pl.Trainer, waited: float | None, stepped: float) -> dict[str, float]:
        """The peak memory (largest over ranks) and ``waited / stepped`` (the ranks' sums), when timed."""
        peak, self.kind = peak_memory_mib(trainer)
        device = trainer.strategy.root_device
        most = torch.tensor([peak], dtype=torch.float64, device=device)
        sums = torch.tensor([waited or 0.0, stepped], dtype=torch.float64, device=device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
            torch.distributed.all_reduce(sums)
        found = {"peak_mem_mib": float(most[0])}
        if waited is not None and float(sums[1]) > 0:
            found["allreduce_share"] = float(sums[0]) / float(sums[1])
        return found
