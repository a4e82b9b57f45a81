"""Lightning's progress bars, throttled, showing only current metrics."""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from typing_extensions import override

from dpddp.data.global_batch import GlobalBatchSampler

BAR_INTERVAL_S = 0.1
"""Seconds between two bar updates of a loop; a loop's last batch is always shown."""


class _ThrottledBar(ProgressBar):
    """A bar updated at most every ``BAR_INTERVAL_S`` seconds per loop and at its last batch; current metrics only."""

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        # train/loss is logged after the bar's epoch end: it would show the previous epoch's value
        items = super().get_metrics(trainer, pl_module)
        return {k: v for k, v in items.items() if k not in ("v_num", "train/loss")}

    def _due(self, loop: str, n: int, total: float) -> bool:
        now, shown = time.monotonic(), self.__dict__.setdefault("_shown_at", {})
        if n >= total or now - shown.get(loop, -math.inf) >= BAR_INTERVAL_S:
            shown[loop] = now
            return True
        return False

    def _steps_per_epoch(self) -> int | None:
        """An epoch's global batches when a training item is an execution of several, else ``None``."""
        sampler = getattr(self.trainer.train_dataloader, "sampler", None)
        if isinstance(sampler, GlobalBatchSampler) and sampler.steps_per_execution > 1:
            return sampler.steps_per_epoch
        return None

    @property
    @override
    def total_train_batches(self) -> int | float:
        steps = self._steps_per_epoch()
        return super().total_train_batches if steps is None else steps

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        *rest, batch_idx = args
        if (steps := self._steps_per_epoch()) is not None:  # the global batches done, as with K=1
            batch_idx = trainer.global_step - trainer.current_epoch * steps - 1
        if self._due("train", batch_idx + 1, self.total_train_batches):
            super().on_train_batch_end(trainer, pl_module, *rest, batch_idx)  # type: ignore[call-arg]

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._due("validate", args[2] + 1, self.total_val_batches_current_dataloader):  # args[2]: batch_idx
            super().on_validation_batch_end(trainer, pl_module, *args)

    @override
    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._due("test", args[2] + 1, self.total_test_batches_current_dataloader):
            super().on_test_batch_end(trainer, pl_module, *args)

    @override
    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._due("predict", args[2] + 1, self.total_predict_batches_current_dataloader):
            super().on_predict_batch_end(trainer, pl_module, *args)


class RichBar(_ThrottledBar, RichProgressBar):
    """Lightning's rich bar, throttled; redrawn at most 1 / ``BAR_INTERVAL_S`` times a second."""

    def __init__(self) -> None:
        super().__init__(refresh_rate=round(1 / BAR_INTERVAL_S))


class TQDMBar(_ThrottledBar, TQDMProgressBar):
    """Lightning's tqdm bar (without ``rich``), throttled."""
