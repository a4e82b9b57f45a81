"""A user's LightningDataModule's batches as global batches over the ranks (docs/design-notes.md, data.sharded)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler
from typing_extensions import override

from dpddp._compat import data_position
from dpddp.data.batches import dataset_rows, empty_batch, with_rows
from dpddp.data.built import data_streams, in_data_streams
from dpddp.data.draws import EpochIds, KeyedSamples
from dpddp.data.global_batch import SplitLoaders, YieldedIds, epoch_generator, split_loader
from dpddp.data.rules import check_divides
from dpddp.errors import ConfigError
from dpddp.parallel.workers import start_workers_safely


def epoch_order(sampler: Sampler, seed: int) -> Callable[[int], list[int]]:
    """The training order of an epoch of ``sampler``: a ``RandomSampler``'s drawn from ``(seed, epoch)``, another's
    told ``set_epoch(epoch)`` and iterated. Raises ConfigError: an order that differs between two iterations."""
    if isinstance(sampler, RandomSampler):
        n, count, replace = len(sampler.data_source), sampler.num_samples, sampler.replacement

        def drawn(epoch: int) -> list[int]:
            gen = epoch_generator(seed, epoch)
            if replace:
                return torch.randint(n, (count,), generator=gen).tolist()
            return torch.cat([torch.randperm(n, generator=gen) for _ in range(-(-count // n))])[:count].tolist()

        return drawn

    def told(epoch: int) -> list[int]:
        if callable(set_epoch := getattr(sampler, "set_epoch", None)):
            set_epoch(epoch)
        return [int(i) for i in sampler]

    if not isinstance(sampler, SequentialSampler) and told(0) != told(0):
        raise ConfigError(
            f"data: the training loader's sampler ({type(sampler).__name__}) gives another order each time it is "
            "iterated, so a continued run would train other batches: order it by the seed and set_epoch(epoch) "
            "(as DistributedSampler does), or use shuffle=True"
        )
    return told


class ShardedBatchSampler(YieldedIds, Sampler[list[int]]):
    """This rank's chunk of each global batch: training, full batches of ``epoch_order`` from the position; else
    ``batches`` as they come. Raises ConfigError: a training batch % ranks, a sampler ``epoch_order`` refuses."""

    def __init__(self, batches: Any, rank: int, world_size: int, train: bool, seed: int = 0) -> None:
        super().__init__(rank, world_size, train, seed)
        self.batches = batches
        self.sampler = getattr(batches, "sampler", None)  # Lightning calls its set_epoch (if it has one)
        if train:
            self.batch_size: int = batches.batch_size
            check_divides(self.batch_size, world_size, key="the data module's training batch_size")
            self.order = epoch_order(self.sampler, seed)  # type: ignore[arg-type]

    def __len__(self) -> int:  # batches per epoch (training: full ones)
        return len(self.sampler) // self.batch_size if self.train else len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[int]]:
        if not self.train:
            for batch in self.batches:
                yield self._chunk(torch.tensor(batch, dtype=torch.long)).tolist()
            return
        epoch, skip = self._start()
        order, b = self.order(epoch), self.batch_size
        for k in range(skip, len(order) // b):  # the epoch travels with the ids, to a worker's data set
            ids = self._chunk(torch.tensor(order[k * b : (k + 1) * b], dtype=torch.long))
            yield EpochIds(self._record(k, epoch, ids).tolist(), epoch)


def _collate(collate: Any, dataset: Any, rows: bool, samples: list) -> Any:
    """``collate(samples)``, of none a sample cut to 0 rows; with ``rows``, of ``(sample, id)``s, their rows added."""
    items = [sample for sample, _ in samples] if rows else samples
    batch = collate(items) if items else empty_batch(collate([dataset[0]]))
    if not rows:
        return batch
    return with_rows(batch, dataset_rows(dataset, torch.tensor([i for _, i in samples], dtype=torch.long)))


def shard_loader(
    loader: Any, rank: int, world_size: int, train: bool, seed: int = 0, with_rows: bool = False
) -> DataLoader:
    """``loader`` (a plain map-style ``DataLoader``) sharded, its draws keyed; ``with_rows``: batches end with their
    rows. Raises ConfigError: a loader that cannot be sharded or ordered."""
    if type(loader) is not DataLoader or isinstance(loader.dataset, IterableDataset) or loader.batch_sampler is None:
        what = type(loader).__name__ if type(loader) is not DataLoader else "a DataLoader without batch_size"
        if isinstance(getattr(loader, "dataset", None), IterableDataset):
            what = "a DataLoader over an IterableDataset"
        raise ConfigError(
            f"data: the data module returns {what}, which dpddp cannot shard over ranks: return a plain "
            "DataLoader(dataset, batch_size=...), or subclass dpddp.data.global_batch.GlobalBatchDataModule"
        )
    if train and type(loader.batch_sampler) is not BatchSampler:
        raise ConfigError(
            f"data: the training loader has a batch sampler of its own ({type(loader.batch_sampler).__name__}): "
            "give DataLoader(dataset, batch_size=..., shuffle=... or sampler=...)"
        )
    batches = ShardedBatchSampler(loader.batch_sampler, rank, world_size, train, seed)
    if train and not len(batches):
        raise ConfigError(
            f"data: the training loader has {len(batches.sampler)} samples, fewer than one batch of "  # type: ignore[arg-type]
            f"{batches.batch_size}: no step would train; use a smaller batch_size or more data"
        )
    kept = ["num_workers", "pin_memory", "timeout", "worker_init_fn", "generator", "persistent_workers"]
    kept += ["multiprocessing_context", "prefetch_factor"] if loader.num_workers else []  # for workers only
    sharded = DataLoader(
        KeyedSamples(loader.dataset, seed, with_rows),
        batch_sampler=batches,
        collate_fn=partial(_collate, loader.collate_fn, loader.dataset, with_rows),
        **{key: getattr(loader, key) for key in kept},
    )
    return start_workers_safely(sharded, rank)  # type: ignore[return-value]


class ShardedDataModule(SplitLoaders):
    """A user's ``module``, its loaders rebuilt by ``shard_loader``, its hooks run inside ``data_streams(seed)``."""

    def __init__(self, module: pl.LightningDataModule, seed: int = 0) -> None:
        super().__init__()
        self.module, self.seed = module, seed
        self.batch_size = 0

    @override
    @in_data_streams
    def prepare_data(self) -> None:
        if isinstance(self.module, pl.LightningDataModule):
            self.module.prepare_data()

    @override
    @in_data_streams
    def setup(self, stage: str) -> None:
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

    @override
    def _loader(self, split: str, rank: int, world_size: int) -> DataLoader:
        with data_streams(self.seed):
            loader = getattr(self.module, f"{split}_dataloader")()
        loader = shard_loader(loader, rank, world_size, split == "train", self.seed, split == "predict")
        if split == "train":
            assert isinstance(loader.batch_sampler, ShardedBatchSampler)
            self.batch_size = loader.batch_sampler.batch_size
            if self.trainer is not None:
                loader.batch_sampler.position = partial(data_position, self.trainer, len(loader.batch_sampler))
        return loader

    predict_dataloader = split_loader("predict")  # each batch followed by its rows in the data set
