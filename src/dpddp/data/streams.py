"""An ``IterableDataset`` in global batches (``data=stream``): every rank reads the stream and keeps its share."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from functools import partial
from itertools import islice
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate
from typing_extensions import override

from dpddp._compat import data_position
from dpddp.data import rules
from dpddp.data.batches import empty_batch
from dpddp.data.draws import get_streams, seed_streams, set_streams, streams_kept
from dpddp.data.global_batch import SplitLoaders, YieldedIds, collate_function
from dpddp.errors import ConfigError
from dpddp.nn import key64

# No workers read a stream here, and __len__ counts this rank's batches exactly.
warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")

STREAM = 0x57EA_DA7A  # folded into the seed first: the stream's own draws stay apart from other keys


class _OwnStreams:
    """``stream``'s samples, read with global random streams seeded from ``key64(STREAM, seed, epoch)``."""

    def __init__(self, stream: Any, seed: int, epoch: int, needed: int) -> None:
        self.stream, self.samples, self.needed, self.count = stream, iter(stream), needed, 0
        with streams_kept():
            seed_streams(key64(STREAM, seed, epoch))
            self.state = get_streams()

    def read(self, count: int) -> list[Any]:
        """The next ``count`` samples. Raises ConfigError: the stream ends before them."""
        with streams_kept():
            set_streams(self.state)
            read = list(islice(self.samples, count))
            self.state = get_streams()
        self.count += len(read)
        if len(read) < count:
            raise ConfigError(
                f"data: the stream ({type(self.stream).__name__}) ended after {self.count} samples, but "
                f"data.num_samples says {self.needed} or more: give the number of samples in one pass"
            )
        return read


class StreamShares(YieldedIds, IterableDataset):
    """This rank's collated share of each global batch of ``stream[start:start + length]`` (training: full ones)."""

    def __init__(
        self,
        stream: Any,
        start: int,
        length: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        train: bool = False,
        seed: int = 0,
        collate: Callable[[list], Any] = default_collate,
    ) -> None:
        super().__init__(rank, world_size, train, seed)
        self.stream, self.start, self.length, self.batch_size, self.collate = stream, start, length, batch_size, collate

    def __len__(self) -> int:
        return self.length // self.batch_size if self.train else -(-self.length // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        epoch, skip = self._start()
        if callable(set_epoch := getattr(self.stream, "set_epoch", None)):
            set_epoch(epoch)
        own, b = _OwnStreams(self.stream, self.seed, epoch, self.start + self.length), self.batch_size
        for done in range(0, self.start + skip * b, 4096):  # past the samples before this split and those trained
            own.read(min(4096, self.start + skip * b - done))
        for k in range(skip, len(self)):
            batch = own.read(min(b, self.length - k * b))
            share = self._record(k, epoch, self._chunk(torch.arange(k * b, k * b + len(batch))))
            mine = [batch[i - k * b] for i in share.tolist()]
            yield self.collate(mine) if mine else empty_batch(self.collate(batch[:1]))


class StreamDataModule(SplitLoaders):
    """``stream`` (``num_samples`` a pass, else its ``len``) cut into ``[train | val | test]``, as ``StreamShares``."""

    def __init__(
        self,
        stream: Any = None,
        num_samples: int | None = None,
        batch_size: int = 64,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        seed: int = 0,
        collate_fn: Any = None,  # a function or its dotted path (Any: the Lightning CLI keeps a path as given)
    ) -> None:
        super().__init__()
        if not isinstance(stream, IterableDataset):
            raise ConfigError(
                f"data.stream={type(stream).__name__}: give an IterableDataset, +data.stream._target_=my_pkg.MyStream"
            )
        if num_samples is None:
            try:
                num_samples = len(stream)  # type: ignore[arg-type]
            except TypeError as err:
                msg = f"data.num_samples=null and {type(stream).__name__} has no len(): give data.num_samples"
                raise ConfigError(msg) from err
        self.stream, self.num_samples, self.batch_size, self.seed = stream, num_samples, batch_size, seed
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.collate_fn = collate_function(collate_fn) or default_collate
        self.cuts: dict[str, tuple[int, int]] = {}

    @override
    def setup(self, stage: str) -> None:
        rules.check_split_settings(self.batch_size, self.val_fraction, self.test_fraction)
        n_train, n_val, n_test = rules.split_sizes(self.num_samples, self.val_fraction, self.test_fraction)
        rules.check_train_split(self.batch_size, n_train, "raise data.num_samples")
        self.cuts = {"train": (0, n_train), "val": (n_train, n_val), "test": (n_train + n_val, n_test)}

    @override
    def _loader(self, split: str, rank: int, world_size: int) -> DataLoader:
        rules.check_divides(self.batch_size, world_size)
        start, length = self.cuts[split]
        shares = StreamShares(
            self.stream, start, length, self.batch_size, rank, world_size, split == "train", self.seed, self.collate_fn
        )
        if split == "train" and self.trainer is not None:
            shares.position = partial(data_position, self.trainer, len(shares))
        return DataLoader(shares, batch_size=None)
