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
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["GlobalBatchSampler", "RandomTensorDataModule", "TensorBatches", "checksum", "make_tensors"]

log = logging.getLogger(__name__)


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

    Raises:
        ValueError: if ``batch_size`` does not divide by ``world_size``.
    """

    def __init__(
        self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1, train: bool = False, seed: int = 0
    ) -> None:
        if batch_size % world_size:
            raise ValueError(
                f"data.batch_size={batch_size} does not divide by the world size {world_size}: "
                f"use a multiple of {world_size}"
            )
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size = rank, world_size
        self.train, self.seed, self.epoch = train, seed, 0
        self.skip = 0  # batches of the next epoch already trained before a mid-epoch checkpoint (resume)

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at each epoch start; selects that epoch's permutation."""
        self.epoch = epoch

    def __len__(self) -> int:
        if self.train:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self.train:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.num_samples, generator=gen)
        else:
            order = torch.arange(self.num_samples)
        skip, self.skip = self.skip, 0
        for k in range(skip, len(self)):
            batch = order[k * self.batch_size : (k + 1) * self.batch_size]
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
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.num_samples, self.num_features, self.num_classes = num_samples, num_features, num_classes
        self.batch_size, self.label_noise, self.seed = batch_size, label_noise, seed
        self.num_val = int(num_samples * val_fraction)
        self.num_test = int(num_samples * test_fraction)
        self.num_train = num_samples - self.num_val - self.num_test
        self.splits: dict[str, TensorBatches] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        x, y = make_tensors(self.seed, self.num_samples, self.num_features, self.num_classes, self.label_noise)
        log.info(f"data checksum {checksum(x, y)} ({self.num_samples} samples x {self.num_features} features)")
        bounds = {"train": (0, self.num_train), "val": (self.num_train, self.num_train + self.num_val)}
        bounds["test"] = (self.num_train + self.num_val, self.num_samples)
        self.splits = {name: TensorBatches(x[a:b], y[a:b]) for name, (a, b) in bounds.items()}

    def _loader(self, split: str, with_index: bool = False) -> DataLoader:
        rank, world_size = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        ds = self.splits[split]
        ds = TensorBatches(ds.x, ds.y, with_index=True) if with_index else ds
        sampler = GlobalBatchSampler(len(ds), self.batch_size, rank, world_size, split == "train", self.seed)
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
