"""``RandomTensorDataModule``: the built-in data (``dpddp.data.synthetic``) in global batches."""

from __future__ import annotations

import logging

import torch
from torch.utils.data import Dataset, TensorDataset
from typing_extensions import override

from dpddp.data.batches import Batches
from dpddp.data.global_batch import GlobalBatchDataModule
from dpddp.data.rules import split_sizes
from dpddp.data.synthetic import BLOCK, StreamingTensors, checksum, make_tensors

log = logging.getLogger(__name__)


class RandomTensorDataModule(GlobalBatchDataModule):
    """``make_tensors``' task cut into ``[train | val | test]``; ``streaming``: as ``StreamingTensors``."""

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
        micro_batch_size: int | str | None = None,
    ) -> None:
        super().__init__(None, batch_size, val_fraction, test_fraction, seed, 0, micro_batch_size)
        self.save_hyperparameters()
        self.num_samples, self.num_features, self.num_classes = num_samples, num_features, num_classes
        self.label_noise, self.streaming = label_noise, streaming
        self.num_train, self.num_val, self.num_test = split_sizes(num_samples, val_fraction, test_fraction)
        self.block_size = BLOCK if streaming else None

    @override
    def make_splits(self) -> dict[str, Dataset]:
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
        return {name: Batches(TensorDataset(x, y), torch.arange(a, b)) for name, (a, b) in bounds.items()}
