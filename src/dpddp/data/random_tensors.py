"""``RandomTensorDataModule``: the built-in data, a learnable task from random tensors (``dpddp.data.synthetic``),
served in global batches (``dpddp.data.global_batch``)."""

from __future__ import annotations

import logging

from torch.utils.data import Dataset
from typing_extensions import override

from dpddp.data.batches import TensorBatches
from dpddp.data.global_batch import GlobalBatchDataModule
from dpddp.data.synthetic import BLOCK, StreamingTensors, checksum, make_tensors

__all__ = ["RandomTensorDataModule"]

log = logging.getLogger(__name__)


class RandomTensorDataModule(GlobalBatchDataModule):
    """A learnable classification task from random tensors (see the module docstring); one user of
    ``GlobalBatchDataModule`` (global batch, same order on every world size, exact evaluation and resume).

    Args:
        num_samples: samples in all splits together.
        num_features: input features per sample.
        num_classes: classes (>= 2).
        batch_size: GLOBAL batch size: samples per optimizer step over all processes; each of the
            ``world_size`` processes takes ``batch_size / world_size``.
        val_fraction, test_fraction: fractions of ``num_samples`` held out for validation and test.
        label_noise: fraction of labels replaced by a uniformly random class (0 = separable task).
        seed: seed of the data and of the training order.
        streaming: generate samples when batches need them (``StreamingTensors``, block-shuffled training
            order) instead of drawing the whole data set at ``setup``: memory independent of ``num_samples``.

    Splits are contiguous slices ``[train | val | test]`` of the i.i.d. samples, fixed by the seed. Training
    drops the last partial global batch: ``len(train_dataloader()) == num_train // batch_size``.
    """

    def __init__(
        self,
        num_samples: int = 4096,
        num_features: int = 16,
        num_classes: int = 4,
        batch_size: int = 64,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        label_noise: float = 0.0,
        seed: int = 0,
        streaming: bool = False,
    ) -> None:
        super().__init__(batch_size=batch_size, val_fraction=val_fraction, test_fraction=test_fraction, seed=seed)
        self.save_hyperparameters()
        self.num_samples, self.num_features, self.num_classes = num_samples, num_features, num_classes
        self.label_noise, self.streaming = label_noise, streaming
        self.num_train, self.num_val, self.num_test = self.split_sizes(num_samples)
        self.block_size = BLOCK if streaming else None

    @override
    def make_splits(self) -> dict[str, Dataset]:
        """Contiguous slices of the generated samples (in memory, or streamed block by block)."""
        bounds = {"train": (0, self.num_train), "val": (self.num_train, self.num_train + self.num_val)}
        bounds["test"] = (self.num_train + self.num_val, self.num_samples)
        sizes = f"{self.num_samples} samples x {self.num_features} features"
        if self.streaming:
            args = (self.seed, self.num_features, self.num_classes, self.label_noise)
            streams = {name: StreamingTensors(*args, offset=a, length=b - a) for name, (a, b) in bounds.items()}
            first = streams["train"]
            log.info(f"data checksum {checksum(first.teacher, *first.block(0))} ({sizes}, streaming: teacher, block 0)")
            return dict(streams)
        x, y = make_tensors(self.seed, self.num_samples, self.num_features, self.num_classes, self.label_noise)
        log.info(f"data checksum {checksum(x, y)} ({sizes})")
        return {name: TensorBatches(x[a:b], y[a:b]) for name, (a, b) in bounds.items()}
