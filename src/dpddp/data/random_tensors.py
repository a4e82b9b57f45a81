"""``RandomTensorDataModule``: the built-in data, a learnable task from random tensors (``dpddp.data.synthetic``),
served in global batches (``dpddp.data.global_batch``)."""

from __future__ import annotations

import copy
import logging

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from dpddp._compat import trained_batches_in_epoch
from dpddp.data.global_batch import GlobalBatchSampler, TensorBatches
from dpddp.data.synthetic import BLOCK, StreamingTensors, checksum, make_tensors

__all__ = ["RandomTensorDataModule"]

log = logging.getLogger(__name__)


class RandomTensorDataModule(pl.LightningDataModule):
    """A learnable classification task from random tensors (see the module docstring).

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
        super().__init__()
        self.save_hyperparameters()
        self.num_samples, self.num_features, self.num_classes = num_samples, num_features, num_classes
        self.batch_size, self.label_noise, self.seed, self.streaming = batch_size, label_noise, seed, streaming
        self.num_val = int(num_samples * val_fraction)
        self.num_test = int(num_samples * test_fraction)
        self.num_train = num_samples - self.num_val - self.num_test
        self.splits: dict[str, TensorBatches | StreamingTensors] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        bounds = {"train": (0, self.num_train), "val": (self.num_train, self.num_train + self.num_val)}
        bounds["test"] = (self.num_train + self.num_val, self.num_samples)
        sizes = f"{self.num_samples} samples x {self.num_features} features"
        if self.streaming:
            args = (self.seed, self.num_features, self.num_classes, self.label_noise)
            streams = {name: StreamingTensors(*args, offset=a, length=b - a) for name, (a, b) in bounds.items()}
            self.splits = dict(streams)
            first = streams["train"]
            log.info(f"data checksum {checksum(first.teacher, *first.block(0))} ({sizes}, streaming: teacher, block 0)")
            return
        x, y = make_tensors(self.seed, self.num_samples, self.num_features, self.num_classes, self.label_noise)
        log.info(f"data checksum {checksum(x, y)} ({sizes})")
        self.splits = {name: TensorBatches(x[a:b], y[a:b]) for name, (a, b) in bounds.items()}

    def _loader(self, split: str, with_index: bool = False) -> DataLoader:
        rank, world_size = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        ds = self.splits[split]
        if with_index:
            ds = copy.copy(ds)
            ds.with_index = True
        block = BLOCK if self.streaming else None
        sampler = GlobalBatchSampler(len(ds), self.batch_size, rank, world_size, split == "train", self.seed, block)
        # batch_size=None: the sampler yields whole index batches and the dataset gathers them in one index.
        return DataLoader(ds, sampler=sampler, batch_size=None)

    def train_dataloader(self) -> DataLoader:
        """Training batches; resuming from a mid-epoch checkpoint, the first epoch skips the batches already
        trained (Lightning restores the step count but restarts a plain loader from the epoch's start)."""
        loader = self._loader("train")
        done = trained_batches_in_epoch(self.trainer) if self.trainer else 0
        if 0 < done < len(loader):
            assert isinstance(loader.sampler, GlobalBatchSampler)
            loader.sampler.skip = done
        return loader

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        """The test split, batches ``(x, y, index)``."""
        return self._loader("test", with_index=True)
