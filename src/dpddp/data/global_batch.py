"""Global batches for any map-style data set, the same on every world size (docs/design-notes.md, data.global_batch)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import suppress
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset
from typing_extensions import override

from dpddp._compat import data_position, locate
from dpddp.data import rules
from dpddp.data.batches import Batches, batch_indexable, defer_rows
from dpddp.data.built import data_streams, in_data_streams
from dpddp.errors import ConfigError, first_line
from dpddp.parallel.workers import start_workers_safely

SPLITS = ("train", "val", "test")


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch)


def collate_function(given: Callable[[list], Any] | str | None) -> Callable[[list], Any] | None:
    """``given``, or the function its dotted path names. Raises ConfigError: a path naming nothing callable."""
    if not isinstance(given, str):
        return given
    with suppress(ImportError, ValueError):
        if callable(found := locate(given)):
            return found
    raise ConfigError(f"data.collate_fn={given!r} names no function: give my_pkg.my_collate (importable)")


class YieldedIds:
    """A sampler's rank share of each global batch (``_chunk``) and the ``(epoch, ids)`` it yielded (``ids_at``)."""

    recorded: int = 256  # more than a loader prefetches
    on_epoch: Callable[[int], None] | None = None  # a data set's set_epoch

    def __init__(self, rank: int, world_size: int, train: bool, seed: int) -> None:
        self.rank, self.world_size, self.train, self.seed, self.epoch = rank, world_size, train, seed, 0
        self.position: Callable[[], tuple[int, int]] | None = None  # training: (epoch, global batches done)
        self._yielded: dict[int, tuple[int, torch.Tensor]] = {}

    def ids_at(self, position: int) -> tuple[int, torch.Tensor] | None:
        """``(epoch, ids)`` of the training item at ``position`` (``batch_idx``), else ``None``; forgets earlier."""
        for earlier in [p for p in self._yielded if p < position]:
            del self._yielded[earlier]
        return self._yielded.get(position)

    def _record(self, position: int, epoch: int, ids: torch.Tensor) -> torch.Tensor:
        if self.train:
            self._yielded[position] = (epoch, ids)
            if len(self._yielded) > self.recorded:
                del self._yielded[next(iter(self._yielded))]
        return ids

    def set_epoch(self, epoch: int) -> None:
        """Select ``epoch``'s order and tell ``on_epoch`` (Lightning calls it before workers copy the data set)."""
        self.epoch = epoch
        if self.on_epoch is not None:
            self.on_epoch(epoch)

    def _start(self) -> tuple[int, int]:
        """``(epoch, global batches of it to skip)`` of an iteration starting now (after Lightning's restore)."""
        self._yielded.clear()
        return self.position() if self.position is not None else (self.epoch, 0)

    def _chunk(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tensor_split(ids, self.world_size)[self.rank]


class GlobalBatchSampler(YieldedIds, DistributedSampler):
    """This rank's int64 ids of each global batch (``[k, b]``: ``k`` steps an execution); ``train``: shuffled by
    ``(seed, epoch)``, full batches. Not wrapped by Lightning. Raises ConfigError: ``batch_size`` % ranks."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        train: bool = False,
        seed: int = 0,
        block_size: int | None = None,
        steps_per_execution: int = 1,
    ) -> None:
        rules.check_divides(batch_size, world_size)
        super().__init__(rank, world_size, train, seed)
        self.num_samples, self.batch_size, self.block_size = num_samples, batch_size, block_size
        self.num_replicas, self.shuffle, self.drop_last = world_size, train, train
        self.steps_per_execution = steps_per_execution

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch (training: full ones only)."""
        return self.num_samples // self.batch_size if self.train else -(-self.num_samples // self.batch_size)

    def __len__(self) -> int:  # global batches, or executions of them
        return -(-self.steps_per_epoch // self.steps_per_execution)

    def _order(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The epoch's ids at positions ``at``: identity (evaluation), a permutation, or whole blocks of
        ``block_size`` permuted with rows ``(a * r + c) mod K`` (``a`` odd), the trailing partial block in order."""
        if not self.train:
            return lambda at: at
        gen = epoch_generator(self.seed, self.epoch)
        if self.block_size is None:
            return torch.randperm(self.num_samples, generator=gen).__getitem__
        k = self.block_size
        perm = torch.randperm(self.num_samples // k, generator=gen)
        a = 2 * int(torch.randint(0, k // 2, (1,), generator=gen)) + 1
        rows = (a * torch.arange(k) + int(torch.randint(0, k, (1,), generator=gen))) % k
        if not len(perm):  # no full block
            return lambda at: at
        last = len(perm) - 1
        return lambda at: torch.where(at // k <= last, rows[at % k] + perm[(at // k).clamp(max=last)] * k, at)

    def __iter__(self) -> Iterator[torch.Tensor]:
        epoch, step = self._start()
        if self.position is not None:
            self.set_epoch(epoch)
        order, b, k, steps = self._order(), self.batch_size, self.steps_per_execution, self.steps_per_epoch
        while step < steps:  # k > 1 (training): full global batches, executions aligned to multiples of k
            end = min((step // k + 1) * k, steps)
            ids = order(torch.arange(step * b, min(end * b, self.num_samples)))
            ids = self._chunk(ids) if k == 1 else ids.view(end - step, self.world_size, -1)[:, self.rank]
            yield self._record(step // k, epoch, ids)
            step = end


def _check_collates(train: Any, collate_fn: Callable[[list], Any] | None) -> None:
    """Raises ConfigError: the first two training samples do not collate into a batch."""
    try:
        train[torch.arange(min(2, len(train)))]
    except (RuntimeError, TypeError, ValueError) as err:
        given = "its collate_fn" if collate_fn is not None else "torch's default_collate (stacks samples of one shape)"
        raise ConfigError(
            f"data: two training samples do not collate into a batch with {given} ({first_line(err, 120)}): samples "
            "of different shapes need data.collate_fn=my_pkg.pad_collate, a function that pads a list of samples"
        ) from err


def split_loader(split: str) -> Callable[[SplitLoaders], DataLoader]:
    """A ``<split>_dataloader`` method: ``_loader(split, rank, world_size)``, the trainer's (``0, 1`` without)."""

    def loader(self: SplitLoaders) -> DataLoader:
        rank, world_size = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        return self._loader(split, rank, world_size)

    return loader


class SplitLoaders(pl.LightningDataModule):
    """A data module whose loaders are ``_loader(split, rank, world_size)``."""

    def _loader(self, split: str, rank: int, world_size: int) -> DataLoader:
        raise NotImplementedError

    train_dataloader = split_loader("train")
    val_dataloader = split_loader("val")
    test_dataloader = split_loader("test")


class GlobalBatchDataModule(SplitLoaders):
    """Map-style ``dataset`` (or a subclass's ``make_dataset``/``make_splits``, inside ``data_streams``) cut by a
    permutation from ``seed`` into ``[train | val | test]`` global batches. Raises ConfigError: unusable data."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for hook in ("prepare_data", "setup"):  # a subclass's own: seeded as make_splits is
            if hook in cls.__dict__:
                setattr(cls, hook, in_data_streams(cls.__dict__[hook]))

    block_size: int | None = None  # GlobalBatchSampler's
    steps_per_execution: int = 1  # GlobalBatchSampler's; set by the run

    def __init__(
        self,
        dataset: Dataset | None = None,
        batch_size: int = 64,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        seed: int = 0,
        num_workers: int = 0,
        micro_batch_size: int | str | None = None,
        collate_fn: Any = None,  # a function or its dotted path (Any: the Lightning CLI keeps a path as given)
    ) -> None:
        super().__init__()
        if isinstance(dataset, IterableDataset):
            raise ConfigError(rules.iterable_refusal(type(dataset).__name__))
        self.collate_fn = collate_function(collate_fn)
        if isinstance(dataset, Dataset):  # at once, before the run starts: the samples collate
            _check_collates(Batches(dataset, None, self.collate_fn), self.collate_fn)
        self.dataset, self.batch_size, self.seed, self.num_workers = dataset, batch_size, seed, num_workers
        self.micro_batch_size = micro_batch_size
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.splits: dict[str, Dataset] = {}

    def make_dataset(self) -> Dataset:
        if self.dataset is None or isinstance(self.dataset, dict):
            raise ConfigError(
                f"{type(self).__name__} has no data set: give +data.dataset._target_=my_pkg.MyDataset or override "
                "make_dataset"
            )
        return self.dataset

    def make_splits(self) -> dict[str, Dataset]:
        """``{"train", "val", "test"}`` -> data sets: cuts of a seeded permutation of ``make_dataset``."""
        dataset = self.make_dataset()
        if isinstance(dataset, IterableDataset):
            raise ConfigError(rules.iterable_refusal(type(dataset).__name__))
        sizes = rules.split_sizes(len(dataset), self.val_fraction, self.test_fraction)  # type: ignore[arg-type]
        perm = torch.randperm(sum(sizes), generator=torch.Generator().manual_seed(self.seed))
        cuts = zip(SPLITS, perm.split(sizes), strict=True)
        return {name: Batches(dataset, ids, self.collate_fn) for name, ids in cuts}

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        rules.check_split_settings(self.batch_size, self.val_fraction, self.test_fraction)
        with data_streams(self.seed):
            splits = self.make_splits()
        self.splits = {k: ds if batch_indexable(ds) else Batches(ds, None, self.collate_fn) for k, ds in splits.items()}
        for split in self.splits.values():
            if isinstance(split, Batches):
                split.seed = self.seed
        rules.check_train_split(self.batch_size, len(self.splits["train"]), "give more data")  # type: ignore[arg-type]
        _check_collates(self.splits["train"], self.collate_fn)

    def defer_training_rows(self) -> bool:
        """Let the training split gather each step's rows as it runs (not with workers); whether it will."""
        return self.num_workers == 0 and "train" in self.splits and defer_rows(self.splits["train"])

    @override
    def _loader(self, split: str, rank: int, world_size: int) -> DataLoader:
        ds = Batches(self.splits["test"], with_index=True) if split == "predict" else self.splits[split]
        train, size = split == "train", len(ds)  # type: ignore[arg-type]
        steps = self.steps_per_execution if train else 1
        sampler = GlobalBatchSampler(size, self.batch_size, rank, world_size, train, self.seed, self.block_size, steps)
        told = ds if isinstance(ds, Batches) else getattr(ds, "dataset", None)
        if train and callable(set_epoch := getattr(told, "set_epoch", None)):
            sampler.on_epoch = set_epoch
        if train and (trainer := self.trainer) is not None:
            per_epoch = sampler.steps_per_epoch
            if steps > 1:  # one global batch a step
                sampler.position = lambda: divmod(trainer.global_step, per_epoch)
            else:
                sampler.position = partial(data_position, trainer, per_epoch)
            sampler.set_epoch(sampler.position()[0])  # a resumed fit's workers copy the data set before Lightning
        loader = DataLoader(ds, sampler=sampler, batch_size=None, num_workers=self.num_workers)
        return start_workers_safely(loader, rank)  # type: ignore[return-value]

    predict_dataloader = split_loader("predict")  # the test split, each batch followed by its rows in the data set
