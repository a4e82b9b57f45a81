"""The epoch table (``metrics.csv``), the epoch line, and the run's training time over its segments."""

from __future__ import annotations

import csv
import logging
import time
from copy import deepcopy
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason
from typing_extensions import override

from dpddp.diagnostics.costs import Costs
from dpddp.report.tally import FitTally

log = logging.getLogger(__name__)

EPOCH_COLUMNS: tuple[str, ...] = ("stage", "epoch", "step", "train/loss", "val/loss", "val/acc", "test/loss")
EPOCH_COLUMNS += ("test/acc", "epoch_s", "samples_per_sec", "peak_mem_mib", "allreduce_share", "world_size")
EPOCH_COLUMNS += ("slowest_rank", "slowest_ratio")
"""The columns of ``metrics.csv``, fixed whatever was logged: one ``fit`` row per epoch, one ``test`` row."""


@dataclass
class EpochTable:
    """``EpochRecord``'s resumable part (a segment: a fit that took a step; validation: the running epoch's last)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    train_time_s: float = 0.0
    segments: int = 0
    world_sizes: list[int] = field(default_factory=list)
    validation: dict[str, float] = field(default_factory=dict)


class EpochRecord(pl.Callback):
    """Writes ``<output_dir>/metrics.csv`` on rank 0 (a ``fit`` row per epoch, and with ``lines`` its log line; a
    ``test`` row) and the early-stop lines. A resumed run extends the checkpoint's rows."""

    TIME_KEY = "perf/train_time_s"

    def __init__(
        self, output_dir: str | Path, tally: FitTally, lines: bool = False, costs: Costs | None = None
    ) -> None:
        self.path, self.tally, self.lines, self.costs = Path(output_dir) / "metrics.csv", tally, lines, costs
        self.table = EpochTable()
        self._segment_start: float | None = None
        self._counted = False  # this fit's segment is counted in table.segments
        self._epoch_start, self._samples = 0.0, 0
        self._pending: dict[str, Any] | None = None

    @property
    def train_time_s(self) -> float:
        """Training seconds over all segments, the running one included."""
        running = time.perf_counter() - self._segment_start if self._segment_start is not None else 0.0
        return self.table.train_time_s + running

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._segment_start, self._counted = time.perf_counter(), False
        # a fit restarted mid-epoch gets no on_train_epoch_start for that epoch: time its rest from here
        self._epoch_start, self._samples = self._segment_start, 0
        self.table.rows = [row for row in self.table.rows if row["epoch"] < trainer.current_epoch]
        if trainer.is_global_zero:
            self._write(self.table.rows, "w")

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.flush(trainer)
        self._epoch_start, self._samples = time.perf_counter(), 0
        self.table.validation = {}

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            metrics = trainer.callback_metrics
            self.table.validation = {k: float(metrics[k]) for k in ("val/loss", "val/acc") if k in metrics}

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._samples += self.tally.samples
        if not self._counted:
            self._counted = True
            self.table.segments += 1
            self.table.world_sizes.append(trainer.world_size)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seconds = time.perf_counter() - self._epoch_start
        self._pending = {
            "stage": "fit",
            "epoch": trainer.current_epoch,
            "step": trainer.global_step,
            "epoch_s": seconds,
            "samples_per_sec": self._samples / seconds if seconds > 0 else float("nan"),
            "world_size": trainer.world_size,
            **self.table.validation,  # the epoch's last validation, before a stop inside it too
            **(self.costs.epoch if self.costs is not None else {}),
        }

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.flush(trainer)
        last, loop = trainer.current_epoch - 1, trainer.fit_loop  # each EarlyStopping that stopped the fit: a line
        held = f"trainer.min_epochs={loop.min_epochs}" if loop.min_epochs else f"trainer.min_steps={loop.min_steps}"
        for callback in trainer.early_stopping_callbacks if trainer.is_global_zero else []:
            if callback.stopping_reason is EarlyStoppingReason.NOT_STOPPED:
                continue
            reason = (callback.stopping_reason_message or callback.stopping_reason.value).strip()
            reason = reason.removesuffix("Signaling Trainer to stop.").strip()
            at = callback.stopped_epoch
            ended = str(at) if last <= at else f"{last} (it tripped after epoch {at}; {held} held the run)"
            log.info(f"EarlyStopping ended the run after epoch {ended}: {reason}")
        if self.tally.stepped:
            self.table.train_time_s = self.train_time_s
        self._segment_start = None

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A finished run continued trains nothing: it keeps its time, count and table (the checkpoint's rows).
        rows = self.table.rows
        if not self.tally.stepped:
            if trainer.is_global_zero:
                self._write(rows, "w")
            last = rows[-1] if rows else {}
            if last.get("step") == trainer.global_step and "train/loss" in last:  # the row of the final weights
                trainer.callback_metrics.setdefault("train/loss", torch.tensor(last["train/loss"]))
        trainer.callback_metrics[self.TIME_KEY] = torch.tensor(self.table.train_time_s, dtype=torch.float64)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            metrics = trainer.callback_metrics
            row: dict[str, Any] = {"stage": "test", "epoch": self.table.rows[-1]["epoch"] if self.table.rows else ""}
            row.update(step=trainer.global_step, world_size=trainer.world_size)
            row.update({k: float(metrics[k]) for k in ("test/loss", "test/acc") if k in metrics})
            self._write([row], "a")

    def snapshot(self) -> EpochTable:
        """The table as a checkpoint taken now holds it: the running segment's seconds included."""
        return replace(deepcopy(self.table), train_time_s=self.train_time_s)

    def flush(self, trainer: pl.Trainer) -> None:
        """Complete the pending row with the epoch's metrics; write it and log its line (rank 0)."""
        if self._pending is None:
            return
        row, self._pending, metrics = self._pending, None, trainer.callback_metrics
        row.update({"train/loss": float(metrics["train/loss"])} if "train/loss" in metrics else {})
        self.table.rows.append(row)
        if trainer.is_global_zero:
            self._write([row], "a")
            if self.lines:
                log.info(self._line(row, trainer.max_epochs))

    @staticmethod
    def _line(row: dict[str, Any], max_epochs: int | None) -> str:
        total = f"/{max_epochs - 1}" if max_epochs not in (None, -1) else ""
        values = " ".join(f"{k}={row[k]:.4f}" for k in ("train/loss", "val/loss", "val/acc") if k in row)
        speed = f"{row['epoch_s']:.2f} s, {row['samples_per_sec']:,.0f} samples/s"
        if "peak_mem_mib" in row:
            speed += f", peak {row['peak_mem_mib']:,.0f} MiB"
        if "allreduce_share" in row:
            speed += f", all-reduce {row['allreduce_share']:.0%} of step time"
        if "slowest_rank" in row and row.get("world_size", 1) >= 2:
            speed += f", slowest rank {row['slowest_rank']} x{row['slowest_ratio']:.2f}"
        return f"epoch {row['epoch']}{total}: {values} ({speed})"

    def _write(self, rows: list[dict[str, Any]], mode: str) -> None:
        header = mode == "w" or not self.path.is_file()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=EPOCH_COLUMNS, restval="")
            if header:
                writer.writeheader()
            writer.writerows(rows)
