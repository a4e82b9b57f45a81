"""``predictions.csv``: the test split's predictions, each sample once, gathered from all ranks."""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from dpddp.data.batches import batch_inputs
from dpddp.data.global_batch import GlobalBatchDataModule
from dpddp.diagnostics.whereabouts import entering
from dpddp.errors import ConfigError

log = logging.getLogger(__name__)


class PredictFailed(RuntimeError):
    """The predict stage failed after the fit and test wrote their outputs."""


def predict_forward(model: pl.LightningModule) -> bool:
    """Give ``model`` without a ``predict_step`` one returning ``model(batch_inputs(batch))`` (``TypeError``: no
    inputs); whether it did. Raises ``ConfigError``: it has no ``forward`` either."""
    if is_overridden("predict_step", model, pl.LightningModule):
        return False
    if not is_overridden("forward", model, pl.LightningModule):
        raise ConfigError(
            f"predict=true: {type(model).__name__} has no predict_step and no forward: give it forward(inputs) or "
            "predict_step(batch, batch_idx) returning [batch] values or [batch, classes] scores"
        )

    def predict_step(batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        inputs = batch_inputs(batch)
        if inputs is None:
            raise TypeError(
                f"{type(model).__name__} has no predict_step, and a {type(batch).__name__} batch has no first "
                "element to give its forward: add predict_step(batch, batch_idx)"
            )
        return model(inputs)

    model.predict_step = predict_step  # type: ignore[method-assign]
    return True


def _number(value: float) -> int | str:
    return "" if math.isnan(value) else int(value) if value.is_integer() else f"{value:.6g}"


class PredictionWriter(BasePredictionWriter):
    """Writes ``predictions.csv`` on rank 0 (``index, target, pred``, ``<scores>_<c>``), sorted by ``index``.
    ``forward``: the model predicts with its ``forward``; setup raises ``ConfigError`` for batches without inputs."""

    def __init__(self, output_dir: str | Path | None = None, scores: str = "prob", forward: bool = False) -> None:
        super().__init__(write_interval="batch")
        self.output_dir, self.scores, self.forward = output_dir, scores, forward
        self.rows: list[torch.Tensor] = []

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        data = trainer.datamodule  # type: ignore[attr-defined]
        if not self.forward or not isinstance(data, GlobalBatchDataModule) or not data.splits.get("test"):
            return
        sample = data.splits["test"][torch.zeros(1, dtype=torch.long)]
        if batch_inputs(sample) is None:
            keys = f" (keys {', '.join(map(str, sample))})" if isinstance(sample, dict) else ""
            raise ConfigError(
                f"predict=true: the data's batches are {type(sample).__name__}s{keys} and "
                f"{type(pl_module).__name__} has no predict_step to read them: add predict_step(batch, batch_idx), "
                "or serve (inputs, target) tuples"
            )

    @override
    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        if not isinstance(prediction, torch.Tensor) or prediction.dim() not in (1, 2):
            what = type(prediction).__name__ if not isinstance(prediction, torch.Tensor) else f"{prediction.dim()}-d"
            raise TypeError(f"predictions.csv takes a tensor [batch] or [batch, classes] per batch, not a {what}")
        rows = batch["index"] if isinstance(batch, dict) else batch[-1]
        out = prediction.detach().to(torch.float64).cpu()
        n = len(rows)
        target = batch[1] if isinstance(batch, (tuple, list)) and len(batch) >= 3 else None  # (x, y, ..., rows)
        known = isinstance(target, torch.Tensor) and target.dim() == 1
        target = target.to(torch.float64).reshape(n, 1).cpu() if known else torch.full((n, 1), math.nan)
        scores = out if out.dim() == 2 and out.shape[1] > 1 else out.reshape(n, -1)[:, :0]
        pred = out.argmax(dim=1, keepdim=True).to(out.dtype) if scores.shape[1] else out.reshape(n, 1)
        self.rows.append(torch.cat([rows.reshape(n, 1).to(torch.float64).cpu(), target, pred, scores], 1))

    @override
    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        mine = torch.cat(self.rows) if self.rows else torch.zeros(0, 3, dtype=torch.float64)
        self.rows = []
        parts = [mine]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * torch.distributed.get_world_size()
            with entering("the predictions' gather"):
                torch.distributed.all_gather_object(gathered, mine)
            parts = gathered
        out = Path(self.output_dir or trainer.log_dir or trainer.default_root_dir)  # log_dir: a broadcast, all ranks
        if not trainer.is_global_zero:
            return
        table = torch.cat([p for p in parts if len(p)] or [mine])
        table = table[table[:, 0].argsort()]
        out.mkdir(parents=True, exist_ok=True)
        path = out / "predictions.csv"
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["index", "target", "pred", *(f"{self.scores}_{c}" for c in range(table.shape[1] - 3))])
            for row in table.tolist():
                writer.writerow([int(row[0]), _number(row[1]), _number(row[2]), *(f"{p:.6g}" for p in row[3:])])
        log.info(f"predictions: {path.absolute()} ({len(table)} rows)")
