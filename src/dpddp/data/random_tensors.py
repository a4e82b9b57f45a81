"""Random-tensor classification data, identical on every rank, with global-batch sampling.

The task: features ``x ~ N(0, 1)`` of shape ``[num_samples, num_features]`` and labels from a fixed random
teacher ``y = argmax(x @ W + b)`` with ``W: [num_features, num_classes]``, optionally with a fraction of labels
replaced by uniformly random classes. Everything is drawn from one ``torch.Generator`` seeded with ``seed``
(never the global RNG), so the tensors are a pure function of ``(seed, sizes)``: every rank of every world size
builds the same ones (the recipe of Lightning's ``BoringDataModule``, made learnable).

Batching follows the project's contract: ``batch_size`` is the GLOBAL batch, the number of samples per
optimizer step over all processes. Training step ``k`` of an epoch takes the global batch
``perm[k * B:(k + 1) * B]`` of that epoch's permutation, and rank ``r`` of ``W`` takes the contiguous
chunk ``[r * B / W, (r + 1) * B / W)`` of it, so every world size sees the same global batches in the same
order and DDP's gradient average equals the single-process mean over ``B`` samples.

Streaming mode (``streaming=True``) holds no data set in memory: sample ``i`` is generated when a batch asks for
it, from the block ``i // BLOCK`` of ``BLOCK`` samples drawn by a generator seeded with ``(seed, block)`` (same
teacher as the in-memory mode, so the same task), and a few recent blocks are cached. Memory no longer grows
with ``num_samples``. The training order is a block shuffle (the technique of sharded streaming loaders such as
WebDataset): each epoch permutes the whole blocks and visits the rows of a block in an affine order ``(a * r +
c) mod BLOCK`` (``a`` odd), both from ``(seed, epoch)``; ids are computed per global batch from positions, so the
order is the same on every world size and no per-sample permutation is ever materialised.
"""

from __future__ import annotations

import copy
import logging
import zlib
from collections.abc import Iterator

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = [
    "BLOCK",
    "GlobalBatchSampler",
    "RandomTensorDataModule",
    "StreamingTensors",
    "TensorBatches",
    "checksum",
    "make_tensors",
]

log = logging.getLogger(__name__)

BLOCK = 4096
"""Samples per generated block in streaming mode (a power of two: the in-block order is affine mod ``BLOCK``)."""


def make_tensors(
    seed: int, num_samples: int, num_features: int, num_classes: int, label_noise: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw the whole data set from a generator seeded with ``seed``.

    Returns:
        ``x``: float32 ``[num_samples, num_features]``; ``y``: int64 ``[num_samples]`` in ``[0, num_classes)``.
    """
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(num_features, num_classes, generator=gen)
    bias = 0.1 * torch.randn(num_classes, generator=gen)
    x = torch.randn(num_samples, num_features, generator=gen)
    y = (x @ teacher + bias).argmax(dim=1)
    if label_noise > 0:
        flip = torch.rand(num_samples, generator=gen) < label_noise
        y = torch.where(flip, torch.randint(0, num_classes, (num_samples,), generator=gen), y)
    return x, y


def checksum(*tensors: torch.Tensor) -> str:
    """CRC32 of the tensors' bytes, as 8 hex digits: equal on two ranks iff they built the same data."""
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.contiguous().numpy(), crc)  # the buffer itself: no copy of the data set
    return f"{crc:08x}"


class TensorBatches(Dataset):
    """A dataset indexed by whole batches: ``ds[idx]`` with ``idx`` an int64 ``[b]`` tensor returns
    ``(x[idx], y[idx])`` in one gather, shapes ``[b, num_features]`` and ``[b]`` (no per-sample collate);
    with ``with_index=True`` also ``idx`` itself (for predictions in dataset order)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, with_index: bool = False) -> None:
        self.x, self.y, self.with_index = x, y, with_index

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.x[idx], self.y[idx], idx) if self.with_index else (self.x[idx], self.y[idx])


def _teacher(seed: int, num_features: int, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher ``W: [num_features, num_classes]`` and bias ``[num_classes]``: the first draws of
    ``make_tensors`` (which stays self-contained: ``bench/plain.py`` compiles it alone)."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(num_features, num_classes, generator=gen)
    return teacher, 0.1 * torch.randn(num_classes, generator=gen)


class StreamingTensors(Dataset):
    """Samples ``[offset, offset + length)`` of an unbounded stream, generated on demand, never stored whole.

    Block ``k`` (samples ``[k * BLOCK, (k + 1) * BLOCK)``) is ``x ~ N(0, 1)`` of shape ``[BLOCK, num_features]``
    from a generator seeded with ``(seed, k)``, labelled like ``make_tensors`` (same teacher, same label noise
    rule). A sample depends only on ``(seed, id)``, not on ``num_samples``, the batch or the world size.
    ``ds[ids]`` with ``ids`` an int64 ``[b]`` tensor of split-local ids returns ``(x [b, num_features], y [b])``
    (and ``ids`` with ``with_index=True``); the last ``cache_blocks`` blocks are kept (``BLOCK *
    (num_features + 2) * 4`` bytes each, 192 KiB at 10 features).
    """

    def __init__(
        self,
        seed: int,
        num_features: int,
        num_classes: int,
        label_noise: float,
        offset: int,
        length: int,
        with_index: bool = False,
        cache_blocks: int = 4,
    ) -> None:
        self.seed, self.num_features, self.num_classes, self.label_noise = seed, num_features, num_classes, label_noise
        self.offset, self.length, self.with_index, self.cache_blocks = offset, length, with_index, cache_blocks
        self.teacher, self.bias = _teacher(seed, num_features, num_classes)
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return self.length

    def block(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``k``: ``x [BLOCK, num_features]`` float32, ``y [BLOCK]`` int64."""
        if k in self._cache:
            return self._cache[k]
        gen = torch.Generator().manual_seed((self.seed * 0x9E3779B97F4A7C15 + k + 1) % 2**63)
        x = torch.randn(BLOCK, self.num_features, generator=gen)
        y = (x @ self.teacher + self.bias).argmax(dim=1)
        if self.label_noise > 0:
            flip = torch.rand(BLOCK, generator=gen) < self.label_noise
            y = torch.where(flip, torch.randint(0, self.num_classes, (BLOCK,), generator=gen), y)
        if len(self._cache) >= self.cache_blocks:
            del self._cache[next(iter(self._cache))]  # the oldest
        self._cache[k] = (x, y)
        return x, y

    def __getitem__(self, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ids = idx + self.offset
        if not len(ids):  # a rank's empty chunk of a short last evaluation batch
            x, y = torch.empty(0, self.num_features), torch.empty(0, dtype=torch.long)
            return (x, y, idx) if self.with_index else (x, y)
        first, last = int(ids.min()) // BLOCK, int(ids.max()) // BLOCK
        if first == last:  # the usual case: one block, one gather
            x, y = self.block(first)
            rows = ids - first * BLOCK
            x, y = x[rows], y[rows]
        else:
            blocks = ids // BLOCK
            uniq = torch.unique(blocks).tolist()
            parts = [self.block(k) for k in uniq]
            rows = torch.searchsorted(torch.tensor(uniq), blocks) * BLOCK + ids % BLOCK
            x, y = torch.cat([p[0] for p in parts])[rows], torch.cat([p[1] for p in parts])[rows]
        return (x, y, idx) if self.with_index else (x, y)


class GlobalBatchSampler(Sampler[torch.Tensor]):
    """Yields this rank's share of each global batch, as an int64 index tensor.

    Args:
        num_samples: size of the split (samples).
        batch_size: global batch size (samples per step over all ranks).
        rank, world_size: this process's global rank and the number of processes.
        train: shuffle with a permutation seeded by ``(seed, epoch)`` and drop the last partial global batch
            (every step then averages exactly ``batch_size`` samples). Otherwise: identity order, every sample
            exactly once, the last global batch split as evenly as it goes (``torch.tensor_split``), so
            evaluation counts no padded duplicate (unlike ``DistributedSampler``) and every rank runs the same
            number of batches.
        seed: shuffle seed.
        block_size: ``None``: the training order is a full permutation (``torch.randperm``, 8 bytes per
            sample); a power of two ``K``: the block shuffle of the streaming mode (whole blocks of ``K`` ids
            permuted, rows of a block in an affine order; the trailing partial block last, in order), computed
            per batch with memory ``O(num_samples / K)`` (a split smaller than one block keeps its order).

    Raises:
        ValueError: if ``batch_size`` does not divide by ``world_size``.
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
    ) -> None:
        if batch_size % world_size:
            raise ValueError(
                f"data.batch_size={batch_size} does not divide by the world size {world_size}: "
                f"use a multiple of {world_size}"
            )
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size = rank, world_size
        self.train, self.seed, self.epoch, self.block_size = train, seed, 0, block_size
        self.skip = 0  # batches of the next epoch already trained before a mid-epoch checkpoint (resume)

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at each epoch start; selects that epoch's permutation."""
        self.epoch = epoch

    def __len__(self) -> int:
        if self.train:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def _epoch_order(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``None`` (evaluation: identity), or this epoch's order from ``(seed, epoch)``: ``(perm, None)``, a
        permutation of the samples (full shuffle), or ``(block perm, in-block rows)`` with rows
        ``(a * r + c) mod K`` for ``r`` in ``[0, K)`` (``a`` odd: a bijection)."""
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
        """The ids at positions ``[start, stop)`` of the epoch's order, int64 ``[stop - start]``; for the block
        shuffle, one slice and add per block the batch touches (ids past the last full block stay in place)."""
        if order is None:
            return torch.arange(start, stop)
        perm, rows = order
        if rows is None:
            return perm[start:stop]
        k, pieces = self.block_size, []
        while start < stop:
            block, r = divmod(start, k)
            end = min(stop, (block + 1) * k)
            full = block < len(perm)
            pieces.append(rows[r : r + end - start] + int(perm[block]) * k if full else torch.arange(start, end))
            start = end
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def __iter__(self) -> Iterator[torch.Tensor]:
        order = self._epoch_order()
        skip, self.skip = self.skip, 0
        for k in range(skip, len(self)):
            batch = self._ids(order, k * self.batch_size, min((k + 1) * self.batch_size, self.num_samples))
            yield torch.tensor_split(batch, self.world_size)[self.rank]


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
            self.splits = {name: StreamingTensors(*args, offset=a, length=b - a) for name, (a, b) in bounds.items()}
            first = self.splits["train"]
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
        progress = self.trainer.fit_loop.epoch_loop.batch_progress.current if self.trainer else None
        if progress is not None and self.trainer.fit_loop.restarting and 0 < progress.processed < len(loader):
            loader.sampler.skip = progress.processed
        return loader

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        """The test split, batches ``(x, y, index)``."""
        return self._loader("test", with_index=True)
