"""``predictions.csv``: the predict split's class probabilities, each sample once, gathered from all ranks."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from typing_extensions import override

__all__ = ["PredictionWriter"]


class PredictionWriter(BasePredictionWriter):
    """Writes ``predictions.csv`` (columns ``index, target, pred, prob_0 .. prob_{C-1}``) for the predict split,
    gathered from all ranks (``torch.distributed.all_gather_object``) and sorted by dataset index, each sample
    once. Expects batches ``(x, y, index)`` and ``predict_step`` outputs of class probabilities ``[b, C]``.

    Args:
        output_dir: where to write; ``None`` = ``trainer.log_dir`` (or ``default_root_dir``).
    """

    def __init__(self, output_dir: str | Path | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output_dir = output_dir
        self.rows: list[torch.Tensor] = []

    @override
    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        _, target, index = batch
        probs = prediction.detach().float().cpu()
        pred = probs.argmax(dim=1, keepdim=True).to(probs.dtype)
        self.rows.append(torch.cat([index[:, None].to(probs.dtype), target[:, None].to(probs.dtype), pred, probs], 1))

    @override
    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        mine = torch.cat(self.rows) if self.rows else torch.zeros(0, 3)
        self.rows = []
        parts = [mine]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, mine)
            parts = gathered
        out = Path(self.output_dir or trainer.log_dir or trainer.default_root_dir)  # log_dir: a broadcast, all ranks
        if not trainer.is_global_zero:
            return
        table = torch.cat([p for p in parts if len(p)])
        table = table[table[:, 0].argsort()]
        out.mkdir(parents=True, exist_ok=True)
        num_classes = table.shape[1] - 3
        with open(out / "predictions.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["index", "target", "pred", *(f"prob_{c}" for c in range(num_classes))])
            for row in table.tolist():
                writer.writerow([int(row[0]), int(row[1]), int(row[2]), *(f"{p:.6g}" for p in row[3:])])
