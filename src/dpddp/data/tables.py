"""Real data with no download: scikit-learn's bundled tables in global batches."""

from __future__ import annotations

import logging

import torch
from sklearn import datasets
from torch.utils.data import Dataset, TensorDataset
from typing_extensions import override

from dpddp.data.global_batch import GlobalBatchDataModule
from dpddp.data.synthetic import checksum
from dpddp.errors import ConfigError

log = logging.getLogger(__name__)

TABLES = {"digits": datasets.load_digits, "breast_cancer": datasets.load_breast_cancer}


class TableDataModule(GlobalBatchDataModule):
    """The table ``name`` of ``TABLES``, standardized. Raises ConfigError: an unknown ``name``, sizes not its own."""

    def __init__(
        self,
        name: str = "digits",
        num_features: int = 64,
        num_classes: int = 10,
        batch_size: int = 64,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        seed: int = 0,
        num_workers: int = 0,
        micro_batch_size: int | str | None = None,
    ) -> None:
        super().__init__(None, batch_size, val_fraction, test_fraction, seed, num_workers, micro_batch_size)
        self.save_hyperparameters()
        self.name, self.num_features, self.num_classes = name, num_features, num_classes

    @override
    def make_dataset(self) -> Dataset:
        if self.name not in TABLES:
            raise ConfigError(f"data.name={self.name!r} is unknown: choose one of {', '.join(TABLES)}")
        x_np, y_np = TABLES[self.name](return_X_y=True)
        x, y = torch.as_tensor(x_np, dtype=torch.float32), torch.as_tensor(y_np, dtype=torch.long)
        for key, real in (("num_features", x.shape[1]), ("num_classes", int(y.max()) + 1)):
            if getattr(self, key) != real:
                raise ConfigError(f"data.{key}={getattr(self, key)} but {self.name} has {real}: set data.{key}={real}")
        std = x.std(dim=0)
        x = (x - x.mean(dim=0)) / torch.where(std > 0, std, torch.ones_like(std))
        log.info(f"data checksum {checksum(x, y)} ({self.name}: {len(y)} samples x {x.shape[1]} features)")
        return TensorDataset(x, y)
