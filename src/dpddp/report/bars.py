"""Lightning's progress bars, counting optimizer steps when a training item fuses several."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from typing_extensions import override

from dpddp.data.global_batch import GlobalBatchSampler


class _StepBar(ProgressBar):
    """Counts an epoch's global batches, not its executions of ``steps_per_execution`` > 1 of them."""

    def _steps_per_epoch(self) -> int | None:
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
        if (steps := self._steps_per_epoch()) is not None:
            batch_idx = trainer.global_step - trainer.current_epoch * steps - 1
        super().on_train_batch_end(trainer, pl_module, *rest, batch_idx)  # type: ignore[call-arg]


class RichBar(_StepBar, RichProgressBar):
    """Lightning's rich bar."""


class TQDMBar(_StepBar, TQDMProgressBar):
    """Lightning's tqdm bar (without ``rich``)."""
