"""``Classifier``: the training, metrics and optimizer the built-in models share (docs/your-model-and-data.md)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from dpddp._compat import HOOK_NAME_ATTRIBUTE

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}


class Classifier(pl.LightningModule):
    """Cross-entropy: a subclass builds ``forward`` (``x -> logits``), saves ``optimizer, lr, momentum, weight_decay``.
    Logs ``{train,val,test}/loss``, ``{val,test}/acc`` an epoch. Raises ``ValueError``: ``dropout`` outside [0, 1)."""

    _FOLD_EVERY = 256  # step losses kept before they are summed into the float64 total

    def __init__(self, num_classes: int, dropout: float = 0.0) -> None:
        super().__init__()
        if not 0 <= dropout < 1:
            raise ValueError(f"model.dropout={dropout!r} is invalid: use a probability in [0, 1)")
        self.train_loss, self.val_loss, self.test_loss = MeanMetric(), MeanMetric(), MeanMetric()
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")
        self._train_loss_sum: torch.Tensor | None = None  # this epoch: sum of per-sample losses on this rank
        self._train_samples = 0
        self._step_losses: list[tuple[torch.Tensor, int]] = []  # (mean loss, samples) of steps not yet summed
        self._carried = (0.0, 0)  # (loss sum, samples) of this epoch before a mid-epoch checkpoint (rank 0 only)

    @override
    def __setattr__(self, name: str, value: object) -> None:
        if name == HOOK_NAME_ATTRIBUTE:  # a string set around every hook call: skip nn.Module's checks
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)  # type: ignore[arg-type]

    def _eval_step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> None:
        x, y = batch
        logits = self(x)
        # Per-sample losses: MeanMetric weighs each rank by its sample count; an empty chunk adds nothing.
        getattr(self, f"{stage}_loss").update(F.cross_entropy(logits, y, reduction="none"))
        if len(y):  # torchmetrics' accuracy cannot take an empty chunk
            getattr(self, f"{stage}_acc").update(logits, y)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self._step_losses.append((loss.detach(), len(y)))  # summed in float64 every _FOLD_EVERY steps, not each step
        if len(self._step_losses) >= self._FOLD_EVERY:
            self._fold_train_losses()
        return loss

    def _fold_train_losses(self) -> None:
        """Add the kept step losses to this epoch's float64 sum and sample count."""
        if not self._step_losses:
            return
        losses, counts = zip(*self._step_losses, strict=True)
        self._step_losses.clear()
        stacked = torch.stack(losses).to(torch.float64)
        total = (stacked * torch.tensor(counts, dtype=torch.float64, device=stacked.device)).sum()
        self._train_loss_sum = total if self._train_loss_sum is None else self._train_loss_sum + total
        self._train_samples += sum(counts)

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
        # Metric objects: Lightning calls compute() (one sync of sums and counts) and reset()
        metrics = {f"{stage}/loss": getattr(self, f"{stage}_loss")}
        if stage != "train":
            metrics[f"{stage}/acc"] = getattr(self, f"{stage}_acc")
        self.log_dict(metrics, prog_bar=stage != "test")

    @override
    def on_train_epoch_start(self) -> None:
        # Not at the epoch's end: a checkpoint written after a mid-epoch stop's epoch-end hooks carries the sums.
        self._train_loss_sum, self._train_samples, self._carried = None, 0, (0.0, 0)
        self._step_losses.clear()

    @override
    def on_train_epoch_end(self) -> None:
        total, samples = self.train_loss_sums()
        if self._train_samples or self._carried[1]:  # the epoch's mean, weight = samples: sums and counts sync
            self.train_loss.update(total / samples, weight=self._train_samples + self._carried[1])
        self._log_epoch("train")

    def train_loss_sums(self) -> torch.Tensor:
        """float64 ``[sum of per-sample train losses, samples]`` this epoch on this rank (rank 0 adds the carried)."""
        self._fold_train_losses()
        local = self._train_loss_sum if self._train_loss_sum is not None else torch.zeros((), dtype=torch.float64)
        carried = self._carried if self.global_rank == 0 else (0.0, 0)
        samples = local.new_tensor(float(self._train_samples + carried[1]), dtype=torch.float64)
        return torch.stack([local.to(torch.float64) + carried[0], samples])

    def train_loss_mark(self) -> tuple[torch.Tensor | None, int]:
        """A copy of this epoch's train-loss sum and sample count, for ``rewind_train_loss``."""
        self._fold_train_losses()
        return self._train_loss_sum, self._train_samples  # (a new tensor each fold: never changed in place)

    def rewind_train_loss(self, mark: tuple[torch.Tensor | None, int]) -> None:
        """Forget the train losses added since ``mark`` (a step retried on the same samples)."""
        self._train_loss_sum, self._train_samples = mark
        self._step_losses.clear()

    def carry_train_loss(self, total: float, samples: int) -> None:
        """Take a restored ``(sum, samples)`` of the epoch before a mid-epoch checkpoint (global rank 0 only)."""
        self._carried = (total, samples)

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
