"""Where a run's memory and time go: peak memory, the all-reduce's share, each rank's seconds, stragglers."""

from __future__ import annotations

import logging
import math
import resource
import socket
import statistics
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from dpddp._compat import epoch_cut
from dpddp.diagnostics.allreduce import AllReduceTimer
from dpddp.diagnostics.whereabouts import entering
from dpddp.parallel.ddp import DDPStrategy
from dpddp.parallel.dp import DataParallelStrategy
from dpddp.report.throughput import ThroughputCounts

log = logging.getLogger(__name__)

STRAGGLER_RATIO = 1.5  # an epoch's compute time, over the ranks' median, from which a rank is warned about


def slowest(compute_s: Sequence[float]) -> tuple[int, float]:
    """The slowest rank (a tie: the lowest) and its ratio to the median (or ``nan``); ``ValueError`` when empty."""
    rank = max(range(len(compute_s)), key=lambda r: (compute_s[r], -r))
    median = statistics.median(compute_s)
    return rank, compute_s[rank] / median if median > 0 else math.nan


def straggler_line(compute_s: Sequence[float], epoch: int, hosts: Sequence[str] | None = None) -> str | None:
    """The straggler line for ``epoch`` when ``slowest``'s ratio reaches ``STRAGGLER_RATIO``, else ``None``."""
    rank, ratio = slowest(compute_s)
    if not ratio >= STRAGGLER_RATIO:
        return None
    host = f" (host {hosts[rank]})" if hosts is not None and rank < len(hosts) else ""
    median = statistics.median(compute_s)
    took = f"took {ratio:.2f}x the median compute time in epoch {epoch}"
    times = f"{compute_s[rank]:.3f} s against {median:.3f} s"
    return f"straggler: rank {rank}{host} {took} ({times}; the other ranks waited for it in the gradient all-reduce)"


def peak_memory_mib(trainer: pl.Trainer) -> tuple[float, str]:
    """This process's peak memory in MiB and its kind: ``"rss"`` or ``"cuda_max_allocated"`` (over its GPUs)."""
    strategy = trainer.strategy
    if strategy.root_device.type == "cuda":
        devices = strategy.parallel_devices if isinstance(strategy, DataParallelStrategy) else [strategy.root_device]
        peak = max(torch.cuda.max_memory_allocated(d) for d in devices or [strategy.root_device])
        return peak / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss"  # KiB on Linux


class Costs(pl.Callback):
    """Fills ``epoch`` at each epoch's end, keeps the run's figures in ``counts`` (resumable), publishes them at
    ``on_fit_end`` (``MEMORY_KEY``, ``SHARE_KEY``) and warns of a straggler."""

    MEMORY_KEY = "perf/peak_mem_mib"
    SHARE_KEY = "perf/allreduce_share"

    def __init__(self, counts: ThroughputCounts) -> None:
        self.counts = counts
        self.epoch: dict[str, float] = {}
        self._base, self._epoch_start = 0.0, (0.0, 0.0)
        self._hosts: list[str] | None = None
        self._timer: AllReduceTimer | None = None

    def _waited(self, settle: bool = False) -> float | None:
        """The run's all-reduce seconds so far, kept in ``counts``; ``None`` when not timed."""
        if self._timer is None:
            return None
        self.counts.allreduce_seconds = self._base + (self._timer.settle() if settle else self._timer.seconds)
        return self.counts.allreduce_seconds

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._base = self.counts.allreduce_seconds
        self._timer = trainer.strategy.allreduce_timer if isinstance(trainer.strategy, DDPStrategy) else None
        if self._timer is not None:
            self._timer.reset()
        self._epoch_start = self.counts.allreduce_seconds, self.counts.fallback_seconds  # a restart mid-epoch
        self._hosts = None

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start = self.counts.allreduce_seconds, self.counts.fallback_seconds

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._waited()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seconds = self._waited(settle=True)
        waited = (seconds - self._epoch_start[0]) if seconds is not None else None
        stepped = self.counts.fallback_seconds - self._epoch_start[1]
        self.epoch = self._over_ranks(trainer, waited, stepped, epoch=trainer.current_epoch)
        compute = self.counts.compute_s_per_rank
        slow = len(compute) >= 2 and self.epoch.get("slowest_ratio", math.nan) >= STRAGGLER_RATIO
        if slow and not epoch_cut(trainer):  # the same on every rank: the host names' all-gather, once a fit
            if self._hosts is None:
                hosts: list[Any] = [None] * torch.distributed.get_world_size()
                with entering("the host-name gather"):
                    torch.distributed.all_gather_object(hosts, socket.gethostname())
                self._hosts = [str(h) for h in hosts]
            line = straggler_line(compute, trainer.current_epoch, self._hosts)
            if line is not None and trainer.is_global_zero:
                log.warning(line)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        found = self._over_ranks(trainer, self._waited(settle=True), self.counts.fallback_seconds)
        self.counts.peak_mem_mib = peak = max(found["peak_mem_mib"], self.counts.peak_mem_mib)  # earlier segments too
        trainer.callback_metrics[self.MEMORY_KEY] = torch.tensor(peak, dtype=torch.float64)
        if "allreduce_share" in found:
            trainer.callback_metrics[self.SHARE_KEY] = torch.tensor(found["allreduce_share"], dtype=torch.float64)

    def rank_figures(self) -> dict[str, Any]:
        """``metrics.json``'s per-rank entries of the last finished epoch, ``nan`` when none was timed."""
        compute, wait = self.counts.compute_s_per_rank, self.counts.wait_s_per_rank
        if not compute:
            keys = ("compute_s_per_rank", "allreduce_wait_s_per_rank", "slowest_rank", "slowest_ratio")
            return dict.fromkeys(keys, math.nan)
        rank, ratio = slowest(compute)
        return {
            "compute_s_per_rank": [round(s, 6) for s in compute],
            "allreduce_wait_s_per_rank": [round(s, 6) for s in wait],
            "slowest_rank": rank,
            "slowest_ratio": ratio,
        }

    def _over_ranks(
        self, trainer: pl.Trainer, waited: float | None, stepped: float, epoch: int | None = None
    ) -> dict[str, float]:
        """Peak memory and all-reduce share over the ranks (one all-gather); for an ``epoch``, the per-rank figures."""
        peak, _ = peak_memory_mib(trainer)
        mine = torch.tensor([peak, waited or 0.0, stepped], dtype=torch.float64, device=trainer.strategy.root_device)
        with entering("the cost gather"):
            table = trainer.strategy.all_gather(mine).reshape(-1, 3).cpu()  # a row per rank
        found: dict[str, float] = {"peak_mem_mib": float(table[:, 0].max())}
        sums = table.sum(dim=0)
        if waited is not None and float(sums[2]) > 0:
            found["allreduce_share"] = float(sums[1]) / float(sums[2])
        if waited is not None and epoch is not None:
            wait = [float(w) for w in table[:, 1]]
            compute = [max(float(s) - w, 0.0) for s, w in zip(table[:, 2], wait, strict=True)]
            self.counts.compute_s_per_rank, self.counts.wait_s_per_rank = compute, wait
            self.counts.ranks_epoch = epoch
            rank, ratio = slowest(compute)
            found.update(slowest_rank=rank, slowest_ratio=ratio)
        return found
