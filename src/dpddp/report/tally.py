"""What a fit has done so far, counted once for every reporter."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.data import extract_batch_size
from typing_extensions import override


def rows(batch: Any) -> int | None:
    """The samples in ``batch`` (Lightning's ``extract_batch_size``), or ``None`` when it holds no tensor."""
    if type(batch) in (tuple, list) and batch and isinstance(batch[0], torch.Tensor) and batch[0].ndim:
        return int(batch[0].shape[0])
    try:
        return extract_batch_size(batch)
    except Exception:  # MisconfigurationException: no tensor in it
        return None


class FitTally(pl.Callback):
    """The running fit's counts for the reporters after it (``batches``, ``samples``: the last training batch's)."""

    def __init__(self, steps_per_execution: int = 1) -> None:
        self.by_steps = steps_per_execution > 1
        self.stepped = False
        self.validated_step: int | None = None
        self.batches, self.samples, self._step = 1, 0, 0

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stepped, self.validated_step = False, None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.by_steps:  # trainer.global_step: a chain of properties, read only when it counts
            self._step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.by_steps:
            self.batches = trainer.global_step - self._step
            self.samples = self.batches * trainer.datamodule.batch_size  # type: ignore[attr-defined]
        else:
            self.samples = (rows(args[1]) or 0) * trainer.world_size  # args[1]: the batch; each rank's is as large
        self.stepped = True

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.validated_step = trainer.global_step
