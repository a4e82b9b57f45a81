"""What a fit has done so far, counted once for every reporter: steps taken, validations run, global batches."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

__all__ = ["FitTally"]


class FitTally(pl.Callback):
    """Counts of the running fit, read by the other reporters (it must come before them in the callback list):
    ``stepped`` (a training step taken), ``validated_step`` (global step of the last validation, or ``None``),
    and ``batches`` (global batches the last training batch trained)."""

    def __init__(self, steps_per_execution: int = 1) -> None:
        self.by_steps = steps_per_execution > 1
        self.stepped = False
        self.validated_step: int | None = None
        self.batches, self._step = 1, 0

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stepped, self.validated_step = False, None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.by_steps:  # trainer.global_step: a chain of properties, read only when it counts
            self._step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.batches = trainer.global_step - self._step if self.by_steps else 1
        self.stepped = True

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.validated_step = trainer.global_step
