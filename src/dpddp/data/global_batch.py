"""Global-batch sampling for any map-style data set: the same batches in the same order on every world size.

``batch_size`` is the GLOBAL batch (samples per optimizer step over all processes): step ``k`` takes
``perm[k * B:(k + 1) * B]`` of the epoch's permutation and rank ``r`` its ``r``-th chunk. See
docs/design-notes.md (data.global_batch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset
from typing_extensions import override

from dpddp._compat import data_position
from dpddp._compat.hydra_main import locate
from dpddp.data import rules
from dpddp.data.batches import Batches, batch_indexable, defer_rows
from dpddp.data.built import data_streams, in_data_streams
from dpddp.errors import ConfigError, first_line
from dpddp.parallel.workers import start_workers_safely

__all__ = ["GlobalBatchDataModule", "GlobalBatchSampler", "YieldedIds", "collate_function", "step_position"]


def step_position(trainer: pl.Trainer, steps_per_epoch: int) -> tuple[int, int]:
    """``(epoch, global batches of it trained)`` from ``trainer.global_step`` (one global batch a step), for
    executions of several steps."""
    epoch, skip = divmod(trainer.global_step, steps_per_epoch)
    return epoch, skip


def collate_function(given: Callable[[list], Any] | str | None) -> Callable[[list], Any] | None:
    """``data.collate_fn``: ``given``, or the function its dotted path names.

    Raises:
        ConfigError: a path that names nothing callable.
    """
    if not isinstance(given, str):
        return given
    try:
        found = locate(given)
    except (ImportError, ValueError):
        found = None
    if not callable(found):
        raise ConfigError(f"data.collate_fn={given!r} names no function: give my_pkg.my_collate (importable)")
    return found


class YieldedIds:
    """A training sampler's record of the ids it yielded, for the sample keys (``dpddp.data.keys``): ``seed`` and
    ``(epoch, ids)`` by position in the epoch (Lightning's ``batch_idx``)."""

    recorded: int = 256
    """Items kept for ``ids_at``: more than a loader prefetches (``num_workers * prefetch_factor`` + 1)."""
    seed: int = 0
    _yielded: dict[int, tuple[int, torch.Tensor]]

    def ids_at(self, position: int) -> tuple[int, torch.Tensor] | None:
        """``(epoch, ids)`` of the training item at ``position`` (Lightning's ``batch_idx``), or ``None``;
        earlier items are forgotten."""
        for earlier in [p for p in self._yielded if p < position]:
            del self._yielded[earlier]
        return self._yielded.get(position)

    def _record(self, position: int, epoch: int, ids: torch.Tensor) -> torch.Tensor:
        self._yielded[position] = (epoch, ids)
        if len(self._yielded) > self.recorded:
            del self._yielded[next(iter(self._yielded))]
        return ids


class GlobalBatchSampler(YieldedIds, DistributedSampler):
    """Yields this rank's share of each global batch (samples), an int64 index tensor; a ``DistributedSampler``
    by type only, so Lightning does not wrap it.

    ``train``: order seeded by ``(seed, epoch)``, last partial global batch dropped; else identity order, every
    sample once, the last batch split by ``torch.tensor_split``. ``block_size``: ``None`` (full permutation) or a
    power of two ``K`` (block shuffle, memory ``O(num_samples / K)``). ``steps_per_execution`` ``k`` (training):
    items of ``[k, batch_size / world_size]``, aligned to multiples of ``k`` in the epoch.

    Raises ``ConfigError`` if ``batch_size`` does not divide by ``world_size`` (``rules.check_divides``).
    """

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
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size, self.num_replicas = rank, world_size, world_size
        self.shuffle = self.drop_last = train
        self.train, self.seed, self.epoch, self.block_size = train, seed, 0, block_size
        self.steps_per_execution = steps_per_execution
        self.skip = 0  # global batches of the next epoch already trained before a mid-epoch checkpoint (resume)
        # training: where the data stream stands, (epoch, global batches done), read as each epoch's iteration starts
        self.position: Callable[[], tuple[int, int]] | None = None
        self._yielded: dict[int, tuple[int, torch.Tensor]] = {}  # training: position in the epoch -> (epoch, ids)
        self.on_epoch: Callable[[int], None] | None = None  # told each epoch of the data (a data set's set_epoch)

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at each epoch start, before the loader's workers copy the data set; selects that
        epoch's permutation and tells ``on_epoch``."""
        self.epoch = epoch
        if self.on_epoch is not None:
            self.on_epoch(epoch)

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch (training: full ones only)."""
        if self.train:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def __len__(self) -> int:
        """Items per epoch: global batches, or executions of ``steps_per_execution`` of them."""
        return -(-self.steps_per_epoch // self.steps_per_execution)

    def _epoch_order(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``None`` (identity), ``(perm, None)`` (full shuffle) or ``(block perm, rows (a * r + c) mod K)``, ``a``
        odd, from ``(seed, epoch)``."""
        if not self.train:
            return None
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        if self.block_size is None:
            return torch.randperm(self.num_samples, generator=gen), None
        k = self.block_size
        perm = torch.randperm(self.num_samples // k, generator=gen)
        a = 2 * int(torch.randint(0, k // 2, (1,), generator=gen)) + 1
        return perm, (a * torch.arange(k) + int(torch.randint(0, k, (1,), generator=gen))) % k

    def _ids(self, order: tuple | None, start: int, stop: int) -> torch.Tensor:
        """The ids at positions ``[start, stop)`` of the epoch's order, int64 ``[stop - start]``."""
        if order is None:
            return torch.arange(start, stop)
        perm, rows = order
        if rows is None:
            return perm[start:stop]
        k, pieces = self.block_size, []
        assert k is not None  # rows come with the block shuffle only
        while start < stop:
            block, r = divmod(start, k)
            end = min(stop, (block + 1) * k)
            full = block < len(perm)
            pieces.append(rows[r : r + end - start] + int(perm[block]) * k if full else torch.arange(start, end))
            start = end
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self.position is not None:  # a generator: this runs at the first batch, after Lightning's restore
            self.epoch, self.skip = self.position()
            if self.on_epoch is not None:  # the data's own epoch (num_workers=0: what the data set sees)
                self.on_epoch(self.epoch)
        order = self._epoch_order()
        skip, self.skip = self.skip, 0
        b, k, steps = self.batch_size, self.steps_per_execution, self.steps_per_epoch
        self._yielded.clear()
        if k == 1:
            for i in range(skip, steps):
                batch = self._ids(order, i * b, min((i + 1) * b, self.num_samples))
                batch = batch if self.world_size == 1 else torch.tensor_split(batch, self.world_size)[self.rank]
                yield self._record(i, self.epoch, batch) if self.train else batch
            return
        step = skip
        while step < steps:  # training: full global batches, each split evenly; this rank's chunks, stacked
            end = min((step // k + 1) * k, steps)
            ids = self._ids(order, step * b, end * b).view(end - step, self.world_size, -1)[:, self.rank]
            yield self._record(step // k, self.epoch, ids)
            step = end


def _check_collates(train: Any, collate_fn: Callable[[list], Any] | None) -> None:
    """Raises ConfigError: the first two training samples do not collate into a batch."""
    try:
        train[torch.arange(min(2, len(train)))]
    except (RuntimeError, TypeError, ValueError) as err:
        given = "its collate_fn" if collate_fn is not None else "torch's default_collate (stacks samples of one shape)"
        raise ConfigError(
            f"data: two training samples do not collate into a batch with {given} ({type(err).__name__}: "
            f"{first_line(err, 120)}): samples of different shapes (sequences) need "
            "data.collate_fn=my_pkg.pad_collate, a function of a list of samples that pads them "
            "(docs/your-model-and-data.md, Text)"
        ) from err


class GlobalBatchDataModule(pl.LightningDataModule):
    """Serves ``dataset`` (or a subclass's ``make_dataset``/``make_splits``) in global batches of ``batch_size``,
    split by one permutation from ``seed`` into ``[train | val | test]`` (``rules.split_sizes``).
    ``micro_batch_size``: ``None``, ``N`` or ``"auto"``, how the run splits each rank's share of a training step
    (``dpddp.run.executions``); the batches served are the same.

    A batch is what the samples collate to: ``(inputs, target, ...)`` for tuple samples (``inputs`` first: what
    a model without a ``predict_step`` is given when predicting, ``dpddp.data.batches.batch_inputs``), or a dict.
    ``collate_fn``: a function of a list of samples (or its dotted path), for samples of different shapes; each
    rank collates its share of each global batch, in the same order on every world size (``None``: torch's
    ``default_collate``). ``dataset``: a map-style data set (an ``IterableDataset`` is refused).

    ``make_dataset``/``make_splits`` (and a subclass's own ``prepare_data``/``setup``) run inside
    ``dpddp.data.built.data_streams(seed)``: data drawn from the global random streams is the same on every rank.

    Raises ``ConfigError``: at construction, an ``IterableDataset`` or a ``collate_fn`` path that names no
    function; at ``setup``, a setting that leaves a split unusable, no data set, or samples that do not collate.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for hook in ("prepare_data", "setup"):  # a subclass's own: seeded as make_splits is
            if hook in cls.__dict__:
                setattr(cls, hook, in_data_streams(cls.__dict__[hook]))

    block_size: int | None = None
    """``None``: full shuffle of the training split; a power of two: block shuffle (see ``GlobalBatchSampler``)."""
    steps_per_execution: int = 1
    """Global batches per training item (``GlobalBatchSampler``); set by the run (``dpddp.run.executions``)."""

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
        """The whole map-style data set that ``make_splits`` cuts (default: the ``dataset`` argument)."""
        if self.dataset is None or isinstance(self.dataset, dict):
            raise ConfigError(
                f"{type(self).__name__} has no data set: give data.dataset._target_=my_pkg.MyDataset or override "
                "make_dataset"
            )
        return self.dataset

    def split_sizes(self, n: int) -> tuple[int, int, int]:
        """``(train, val, test)`` sample counts of ``n`` samples (``dpddp.data.rules.split_sizes``)."""
        return rules.split_sizes(n, self.val_fraction, self.test_fraction)

    def make_splits(self) -> dict[str, Dataset]:
        """``{"train", "val", "test"}`` -> map-style data sets: the seeded permutation of ``make_dataset``'s ids."""
        dataset = self.make_dataset()
        if isinstance(dataset, IterableDataset):
            raise ConfigError(rules.iterable_refusal(type(dataset).__name__))
        num_train, num_val, _ = self.split_sizes(len(dataset))  # type: ignore[arg-type]
        perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(self.seed))  # type: ignore[arg-type]
        cuts = {"train": perm[:num_train], "val": perm[num_train : num_train + num_val]}
        cuts["test"] = perm[num_train + num_val :]
        return {name: Batches(dataset, ids, self.collate_fn) for name, ids in cuts.items()}

    @override
    def setup(self, stage: str | None = None) -> None:
        """Build the splits once (the same on every rank). Raises ``ConfigError`` (see the class)."""
        if self.splits:
            return
        rules.check_split_settings(self.batch_size, self.val_fraction, self.test_fraction)
        with data_streams(self.seed):
            splits = self.make_splits()
        self.splits = {k: ds if batch_indexable(ds) else Batches(ds, None, self.collate_fn) for k, ds in splits.items()}
        for split in self.splits.values():
            if isinstance(split, Batches):  # its samples' draws from the global streams are keyed by this seed
                split.seed = self.seed
        rules.check_train_split(self.batch_size, len(self.splits["train"]), "give more data")  # type: ignore[arg-type]
        _check_collates(self.splits["train"], self.collate_fn)

    def defer_training_rows(self) -> bool:
        """Let each execution of the training split gather a step's rows as the step runs (``DeferredRows``);
        whether it will: only with ``num_workers=0``, since a worker would send the whole source with each batch."""
        return self.num_workers == 0 and "train" in self.splits and defer_rows(self.splits["train"])

    def _loader(self, split: str, with_index: bool = False) -> DataLoader:
        rank, world_size = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        ds = self.splits[split]
        if with_index:
            ds = Batches(ds, with_index=True)
        train, size = split == "train", len(ds)  # type: ignore[arg-type]
        steps = self.steps_per_execution if train else 1
        sampler = GlobalBatchSampler(size, self.batch_size, rank, world_size, train, self.seed, self.block_size, steps)
        # batch_size=None: the sampler yields whole index batches and the dataset gathers them in one index.
        loader = DataLoader(ds, sampler=sampler, batch_size=None, num_workers=self.num_workers)
        return start_workers_safely(loader, rank)  # type: ignore[return-value]

    @override
    def train_dataloader(self) -> DataLoader:
        """Training batches; each epoch starts at ``dpddp._compat.data_position`` (a resume skips those trained).
        A data set with ``set_epoch(epoch)`` is told each epoch (for ``dpddp.nn.sample_generator``), and the
        ``Batches`` split keys its samples' global draws by it (``dpddp.data.draws``): from the restored position
        already here, since Lightning makes a resumed fit's first iterator, whose workers copy the data set, before
        it tells the sampler the epoch."""
        loader = self._loader("train")
        sampler = loader.sampler
        train = self.splits["train"]
        told = train if isinstance(train, Batches) else getattr(train, "dataset", None)
        if callable(set_epoch := getattr(told, "set_epoch", None)):  # per-sample augmentation keyed by the epoch
            sampler.on_epoch = set_epoch  # type: ignore[attr-defined]
        if self.trainer is not None:
            assert isinstance(sampler, GlobalBatchSampler)
            by_steps = partial(step_position, self.trainer, sampler.steps_per_epoch)
            by_batches = partial(data_position, self.trainer, sampler.steps_per_epoch)
            sampler.position = by_steps if sampler.steps_per_execution > 1 else by_batches
            if sampler.on_epoch is not None:
                sampler.on_epoch(sampler.position()[0])
        return loader

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    @override
    def predict_dataloader(self) -> DataLoader:
        """The test split, each batch followed by its samples' rows in the whole data set (``(x, y, rows)``; an
        ``"index"`` key for a dict batch)."""
        return self._loader("test", with_index=True)
