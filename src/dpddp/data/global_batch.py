"""Global-batch sampling for any map-style data set: the same batches in the same order on every world size.

Batching follows the project's contract: ``batch_size`` is the GLOBAL batch, the number of samples per
optimizer step over all processes. Training step ``k`` of an epoch takes the global batch
``perm[k * B:(k + 1) * B]`` of that epoch's permutation, and rank ``r`` of ``W`` takes the contiguous
chunk ``[r * B / W, (r + 1) * B / W)`` of it, so every world size sees the same global batches in the same
order and DDP's gradient average equals the single-process mean over ``B`` samples.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, Sampler

__all__ = ["GlobalBatchSampler", "TensorBatches"]


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
        assert k is not None  # rows come with the block shuffle only
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
