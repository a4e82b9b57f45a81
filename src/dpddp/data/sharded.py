"""A user's own LightningDataModule with its own DataLoaders, sharded: each global batch of its loaders split
over the ranks (``ShardedDataModule``), never the whole epoch on every rank."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler
from typing_extensions import override

from dpddp._compat import data_position
from dpddp.data.batches import empty_batch
from dpddp.errors import ConfigError

__all__ = ["ShardedBatchSampler", "ShardedDataModule", "shard_loader"]


class ShardedBatchSampler(Sampler[list[int]]):
    """This rank's share of each batch of ``batches`` (a batch sampler whose batches are GLOBAL batches): rank
    ``r`` of ``W`` takes chunk ``r`` of ``torch.tensor_split(batch, W)``. Training drops a short last batch on
    every world size; evaluation visits every sample once. ``position() -> (epoch, batches trained)``, read as an
    epoch's iteration starts, skips the batches already trained (mid-epoch resume).

    Raises:
        ConfigError: a training batch that does not divide by ``world_size``.
    """

    def __init__(self, batches: Any, rank: int, world_size: int, train: bool) -> None:
        self.batches, self.rank, self.world_size, self.train = batches, rank, world_size, train
        self.sampler = getattr(batches, "sampler", None)  # Lightning calls its set_epoch (if it has one)
        self.position: Callable[[], tuple[int, int]] | None = None

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        skip = self.position()[1] if self.position is not None else 0
        full = None
        for k, batch in enumerate(self.batches):
            batch = list(batch)
            full = full or len(batch)
            if self.train and len(batch) < full:
                return
            if self.train and len(batch) % self.world_size:
                raise ConfigError(
                    f"the data module's training batch of {len(batch)} samples does not divide by the world size "
                    f"{self.world_size}: use a batch size that is a multiple of {self.world_size}"
                )
            if k >= skip:
                yield [int(i) for i in torch.tensor_split(torch.tensor(batch), self.world_size)[self.rank]]


class _CollateOrEmpty:
    """The loader's ``collate_fn``, with an empty list collated as one sample cut to 0 rows."""

    def __init__(self, collate: Any, dataset: Any) -> None:
        self.collate, self.dataset = collate, dataset

    def __call__(self, samples: list) -> Any:
        return self.collate(samples) if len(samples) else empty_batch(self.collate([self.dataset[0]]))


def shard_loader(loader: Any, rank: int, world_size: int, train: bool) -> DataLoader:
    """``loader`` (a plain ``torch.utils.data.DataLoader`` over a map-style data set, batched by a sampler)
    rebuilt with a ``ShardedBatchSampler``: its batch size becomes the global batch.

    Raises:
        ConfigError: a loader that cannot be sharded this way (another class, an iterable data set, or no
            batch sampler), with what to do instead.
    """
    fix = (
        "return a plain DataLoader(dataset, batch_size=...), or subclass dpddp.data.global_batch.GlobalBatchDataModule"
    )
    if type(loader) is not DataLoader or isinstance(loader.dataset, IterableDataset) or loader.batch_sampler is None:
        what = type(loader).__name__ if type(loader) is not DataLoader else "a DataLoader without batch_size"
        if isinstance(getattr(loader, "dataset", None), IterableDataset):
            what = "a DataLoader over an IterableDataset"
        raise ConfigError(f"data: the data module returns {what}, which dpddp cannot shard over ranks: {fix}")
    batches = ShardedBatchSampler(loader.batch_sampler, rank, world_size, train)
    workers = loader.num_workers
    return DataLoader(
        loader.dataset,
        batch_sampler=batches,
        num_workers=workers,
        collate_fn=_CollateOrEmpty(loader.collate_fn, loader.dataset),
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context if workers else None,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=loader.persistent_workers,
    )


class ShardedDataModule(pl.LightningDataModule):
    """Wraps a user's ``LightningDataModule`` (``data.module._target_=my_pkg.MyDataModule``) whose loaders are
    plain DataLoaders, each rebuilt by ``shard_loader``. The same order on every world size and an exact mid-epoch
    resume then need the user's sampler to order by seed and epoch (a seeded ``generator``, or ``set_epoch``)."""

    def __init__(self, module: pl.LightningDataModule) -> None:
        super().__init__()
        self.module = module

    @override
    def prepare_data(self) -> None:
        if isinstance(self.module, pl.LightningDataModule):
            self.module.prepare_data()

    @override
    def setup(self, stage: str) -> None:
        """Raises: ConfigError: ``module`` is not a LightningDataModule (``data.module._target_`` unset)."""
        if not isinstance(self.module, pl.LightningDataModule):
            raise ConfigError(f"data.module={self.module!r} is not a data module: set data.module._target_=pkg.MyData")
        self.module.trainer = self.trainer
        self.module.setup(stage)

    @override
    def teardown(self, stage: str) -> None:
        self.module.teardown(stage)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.module.load_state_dict(state_dict)

    def _shard(self, loader: Any, train: bool) -> DataLoader:
        rank, world_size = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        return shard_loader(loader, rank, world_size, train)

    @override
    def train_dataloader(self) -> DataLoader:
        loader = self._shard(self.module.train_dataloader(), train=True)
        if self.trainer is not None:
            assert isinstance(loader.batch_sampler, ShardedBatchSampler)
            loader.batch_sampler.position = partial(data_position, self.trainer)
        return loader

    @override
    def val_dataloader(self) -> DataLoader:
        return self._shard(self.module.val_dataloader(), train=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._shard(self.module.test_dataloader(), train=False)

    @override
    def predict_dataloader(self) -> DataLoader:
        return self._shard(self.module.predict_dataloader(), train=False)
