"""Random-tensor classification data from ``seed``, whole or block by block (torch only: ``bench/`` imports it)."""

from __future__ import annotations

import zlib

import torch
from torch.utils.data import Dataset

BLOCK = 4096  # samples a streamed block (a power of two: the in-block order is affine mod BLOCK)


def teacher(gen: torch.Generator, num_features: int, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher ``W: [num_features, num_classes]`` and bias, the first draws of ``gen``."""
    return torch.randn(num_features, num_classes, generator=gen), 0.1 * torch.randn(num_classes, generator=gen)


def label(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, label_noise: float, num_classes: int, gen: torch.Generator
) -> torch.Tensor:
    """int64 ``argmax(x @ w + b)``, a fraction ``label_noise`` (drawn from ``gen``) replaced by a random class."""
    y = (x @ w + b).argmax(dim=1)
    if label_noise > 0:
        flip = torch.rand(len(x), generator=gen) < label_noise
        y = torch.where(flip, torch.randint(0, num_classes, (len(x),), generator=gen), y)
    return y


def make_tensors(
    seed: int, num_samples: int, num_features: int, num_classes: int, label_noise: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` float32 ``[num_samples, num_features]`` and ``y`` int64 ``[num_samples]``, drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    w, b = teacher(gen, num_features, num_classes)
    x = torch.randn(num_samples, num_features, generator=gen)
    return x, label(x, w, b, label_noise, num_classes, gen)


CHECKSUM_BYTES = 1 << 24  # the most bytes of one tensor that checksum reads


def checksum(*tensors: torch.Tensor) -> str:
    """CRC32 of the tensors' bytes as 8 hex digits; of a tensor over ``CHECKSUM_BYTES``, evenly spaced rows."""
    crc = 0
    for t in tensors:
        if t.dim() and len(t) > 1 and t.nbytes > CHECKSUM_BYTES:
            rows = max(2, CHECKSUM_BYTES * len(t) // t.nbytes)
            t = t.index_select(0, torch.arange(rows) * (len(t) - 1) // (rows - 1))
        crc = zlib.crc32(t.contiguous().numpy().data, crc)  # the buffer itself: no copy of a small data set
    return f"{crc:08x}"


class StreamingTensors(Dataset):
    """Samples ``[offset, offset + length)`` of an unbounded stream, each a function of ``(seed, id)``: ``ds[ids]``
    is ``(x [b, num_features], y [b])``; the last ``cache_blocks`` blocks kept."""

    batch_indexable = True
    cache_blocks = 4

    def __init__(
        self, seed: int, num_features: int, num_classes: int, label_noise: float, offset: int, length: int
    ) -> None:
        self.seed, self.num_features, self.num_classes, self.label_noise = seed, num_features, num_classes, label_noise
        self.offset, self.length = offset, length
        self.teacher, self.bias = teacher(torch.Generator().manual_seed(seed), num_features, num_classes)
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return self.length

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        return positions + self.offset

    def block(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``k``: ``x [BLOCK, num_features]`` float32, ``y [BLOCK]`` int64."""
        if k not in self._cache:
            gen = torch.Generator().manual_seed((self.seed * 0x9E3779B97F4A7C15 + k + 1) % 2**63)
            x = torch.randn(BLOCK, self.num_features, generator=gen)
            self._cache[k] = x, label(x, self.teacher, self.bias, self.label_noise, self.num_classes, gen)
            if len(self._cache) > self.cache_blocks:
                del self._cache[next(iter(self._cache))]  # the oldest
        return self._cache[k]

    def __getitem__(self, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ids = idx + self.offset
        if not len(ids):  # a rank's empty chunk of a short last evaluation batch
            return torch.empty(0, self.num_features), torch.empty(0, dtype=torch.long)
        blocks = torch.unique(ids // BLOCK)
        parts = [self.block(k) for k in blocks.tolist()]  # usually one: no copy of it
        x, y = parts[0] if len(parts) == 1 else (torch.cat(part) for part in zip(*parts, strict=True))
        rows = torch.searchsorted(blocks, ids // BLOCK) * BLOCK + ids % BLOCK
        return x[rows], y[rows]
