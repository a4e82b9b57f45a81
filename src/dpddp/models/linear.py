"""The linear classifier: one ``nn.Linear``, cross-entropy, exact per-stage metrics."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from dpddp._compat import HOOK_NAME_ATTRIBUTE

__all__ = ["LinearClassifier"]

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}


class LinearClassifier(pl.LightningModule):
    """Logistic regression: ``logits = x @ W.T + b``, ``x: [batch, num_features] -> [batch, num_classes]``.

    Args:
        num_features: input features per sample.
        num_classes: output classes.
        optimizer: ``"sgd"`` (with ``momentum``) or ``"adam"``.
        lr: learning rate.
        momentum: SGD momentum (ignored by Adam).
        weight_decay: L2 penalty.

    Logs at epoch end, synced over all processes by torchmetrics (sums and counts, so every sample counts
    once whatever the world size): ``train/loss``, ``val/loss``, ``val/acc``, ``test/loss``, ``test/acc``.
    Losses are means over samples. Nothing here knows ranks or devices: the Trainer's strategy owns them.

    Per training step the only bookkeeping is one in-place add of the detached loss into a running sum; the
    ``train_loss`` metric takes that sum once per epoch (a per-step ``MeanMetric.update`` cost ~0.3 ms of a
    ~1 ms step on small batches: ``bench/``).
    """

    # Lightning sets ``_current_fx_name`` (``dpddp._compat``) on the module around every hook it calls (~20 times
    # per training step); ``nn.Module.__setattr__`` spends microseconds each checking parameters, buffers and
    # submodules.
    _PLAIN_ATTRIBUTES = frozenset({HOOK_NAME_ATTRIBUTE})

    def __init__(
        self,
        num_features: int = 16,
        num_classes: int = 4,
        optimizer: str = "sgd",
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.linear = nn.Linear(num_features, num_classes)
        # One metric object per stage (sums and counts; synced across processes at compute()).
        self.train_loss, self.val_loss, self.test_loss = MeanMetric(), MeanMetric(), MeanMetric()
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")
        self._train_loss_sum: torch.Tensor | None = None  # this epoch: sum of per-sample losses on this rank
        self._train_samples = 0

    @override
    def __setattr__(self, name: str, value: object) -> None:
        if name in self._PLAIN_ATTRIBUTES:  # a string, never a parameter, buffer or module
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)  # type: ignore[arg-type]

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [batch, num_features]`` float -> logits ``[batch, num_classes]``."""
        return self.linear(x)

    def _eval_step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> None:
        x, y = batch
        logits = self(x)
        # Per-sample losses: MeanMetric weighs each rank by its sample count; an empty chunk adds nothing.
        getattr(self, f"{stage}_loss").update(F.cross_entropy(logits, y, reduction="none"))
        if len(y):  # torchmetrics' accuracy cannot take an empty chunk
            getattr(self, f"{stage}_acc").update(logits, y)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Mean cross-entropy of this rank's chunk ``x: [b, num_features]``, ``y: [b]`` (``b`` = per-device batch
        size, never 0 in training)."""
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self._train_loss_sum is None:
            self._train_loss_sum = torch.zeros((), dtype=torch.float64, device=loss.device)
        self._train_loss_sum.add_(loss.detach(), alpha=len(y))
        self._train_samples += len(y)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    @override
    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    @override
    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Class probabilities ``[batch, num_classes]``."""
        return self(batch[0]).softmax(dim=1)

    def _log_epoch(self, stage: str) -> None:
        # Logged as Metric objects at epoch end: Lightning calls compute() (one torchmetrics sync of sums and
        # counts across processes) and reset(); no per-step logging cost.
        metrics = {f"{stage}/loss": getattr(self, f"{stage}_loss")}
        if stage != "train":
            metrics[f"{stage}/acc"] = getattr(self, f"{stage}_acc")
        self.log_dict(metrics, prog_bar=stage != "test")

    @override
    def on_train_epoch_end(self) -> None:
        if self._train_samples:  # the epoch's mean with weight = samples: sums and counts sync as before
            total = self._train_loss_sum
            assert total is not None
            self.train_loss.update(total / self._train_samples, weight=self._train_samples)
        self._train_loss_sum, self._train_samples = None, 0
        self._log_epoch("train")

    @override
    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    @override
    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        kwargs = {"momentum": hp["momentum"]} if hp["optimizer"] == "sgd" else {}
        optimizer = OPTIMIZERS[hp["optimizer"]]
        return optimizer(self.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"], **kwargs)
