"""A data set's draws from the global random streams (torch's CPU stream, numpy's and Python's, which torchvision's
transforms and most augmentation code use), keyed by the sample: ``Batches`` fetches sample ``i`` of epoch
``epoch`` with the three streams seeded from ``sample_seeds(seed, epoch, i)``, and in the rank leaves them as they
were before the batch. A sample's draws then depend on ``(seed, epoch, i)`` alone, not on the loader's workers,
the batches fetched ahead, the world size or a stop; and the model's draws from those streams do not depend on
the data's. See docs/design-notes.md (data.draws).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch.utils.data import get_worker_info

from dpddp.nn import key64, sample_states

__all__ = ["STREAMS", "sample_seeds", "seed_streams", "streams_kept"]

STREAMS = 0x5EED_DA7A
"""Folded into the seed first: these keys stay apart from ``dpddp.nn.sample_generator``'s."""

_U64 = (1 << 64) - 1


def sample_seeds(seed: int, epoch: int, ids: torch.Tensor) -> list[int]:
    """The 64-bit seed of each id (int64 ``[b]``): ``key64(key64(STREAMS, seed), epoch, id)``."""
    return [s & _U64 for s in sample_states(key64(STREAMS, seed), epoch, ids.reshape(-1)).tolist()]


def seed_streams(key: int) -> None:
    """Seed torch's CPU stream with ``key`` (64 bits), numpy's with its high 32 bits, Python's with ``key``."""
    torch.default_generator.manual_seed(key)
    np.random.seed(key >> 32)
    random.seed(key)


@contextmanager
def streams_kept() -> Iterator[None]:
    """The three global streams as they were before the block, after it; in a loader worker, whose streams serve
    only its data set, nothing is kept."""
    if get_worker_info() is not None:
        yield
        return
    saved = torch.default_generator.get_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.default_generator.set_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])
